"""Worker-group calls on the real Ray backend (what the local-backend tests cannot show):

- A broadcast where rank 1 (not rank 0) raises reaches every rank, and its caller gets rank 1's own error (its type
  and message; Ray's error is an instance of it) with the note naming the failing rank, in the same words as the
  local backend's (run on both here).
- An inference worker's weight-update steps run one at a time on a Ray actor that serves calls on a pool of threads
  (`max_concurrency`, the request API): an `abort_weight_update` sent while a receive still runs waits for it, then
  puts back the old weights. Run beside it, the abort restored the old weights and the bucket landing afterwards was
  written into them (a mix, served under the old version).

One Ray instance for the module (`ray_session`); workers live in ray_call_workers.py, which Ray workers import.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from roll_core.cluster.group import RayOptions, WorkerGroup
from roll_core.cluster.infer_role import InferWorker

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the controller imports the workers as Ray workers do (the fixture's PYTHONPATH)
from ray_call_workers import BlockingReceiver, Flaky, RowMissing  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_session() -> Iterator[Any]:
    """A local Ray instance for this module's tests, stopped at its end; the signal handlers `ray.init` replaces
    (SIGTERM, SIGINT) are given back, so later tests in the same process start from the ones they had."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        # An instance an earlier module of this process left running (tests/e2e's shared one, which the next
        # module that wants it starts again): this module needs its own (its workers' PYTHONPATH, its CPUs), so it stops
        # that one; it skipped instead, whenever it ran after an e2e module in the same xdist worker.
        ray.shutdown()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ray.init(
        address="local",  # a new instance even when another cluster runs on this machine
        num_cpus=4,
        include_dashboard=False,
        namespace="roll-core-tests",
        runtime_env={
            "env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
        },
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_call_where_rank_1_raises_reaches_every_rank_and_raises_its_own_error_noted(
    backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "ray":
        request.getfixturevalue("ray_session")
    group = WorkerGroup(Flaky, 3, backend, name="flaky", ray_options=RayOptions(num_cpus=0.1), fail_rank=1)
    try:
        with pytest.raises(RowMissing, match="rank 1 has no row 7") as raised:
            group.call(Flaky.fail_on, 7)
        notes = getattr(raised.value, "__notes__", [])
        assert [n for n in notes if n.startswith("flaky.fail_on() raised on rank(s) 1 of the 3 called")], notes
        assert not [n for n in notes if "rank(s) 0" in n or "rank(s) 2" in n], notes  # only the rank that failed
        # Every rank ran the call once: rank 1's error stopped none of them (a Ray actor serves one call at a time,
        # so `called` runs after the call it counts).
        assert group.call(Flaky.called) == [1, 1, 1]
    finally:
        group.shutdown()


def _wait_for_step(group: WorkerGroup[BlockingReceiver], step: str, wait_s: float = 60.0) -> list[str]:
    """The worker's steps once `step` is among them (polled: the actor answers on another of its threads)."""
    deadline = time.monotonic() + wait_s
    while True:
        steps = group.call(BlockingReceiver.steps)[0]
        if step in steps:
            return steps
        assert time.monotonic() < deadline, f"{step!r} not reached within {wait_s}s: {steps}"
        time.sleep(0.05)


def test_an_abort_sent_while_a_receive_runs_waits_for_it_on_a_threaded_ray_actor(ray_session: Any) -> None:
    ray = ray_session
    group = WorkerGroup(
        BlockingReceiver, 1, "ray", name="receiver", ray_options=RayOptions(num_cpus=0.1, max_concurrency=4)
    )
    try:
        group.call(InferWorker.begin_weight_update)
        receiving = group.submit(InferWorker.receive_weights_object_store, [ray.put({"w": 1.0})])
        _wait_for_step(group, "receive started")
        aborting = group.submit(InferWorker.abort_weight_update, "the trainer's call timed out")
        _wait_for_step(group, "abort called")
        # The abort reached the worker while the receive blocks: it waits for it (beside it, it returned at once).
        assert not aborting.wait(timeout=3.0)
        assert group.call(BlockingReceiver.steps) == [["begin", "receive started", "abort called"]]

        group.call(BlockingReceiver.release)
        assert receiving.values() == [1]  # the bucket landed...
        assert aborting.values() == [0]  # ...then the abort undid it, keeping the old version
        assert group.call(BlockingReceiver.steps) == [
            ["begin", "receive started", "abort called", "receive ended", "abort"]
        ]
        assert group.call(BlockingReceiver.weights) == [{"w": 0.0}]  # the old weights whole, not the bucket's
    finally:
        group.shutdown()
