"""Worker-group calls on the real Ray backend (what the local-backend tests cannot show):

- A broadcast where rank 1 (not rank 0) raises reaches every rank, and its caller gets rank 1's own error (its type
  and message; Ray's error is an instance of it) with the note naming the failing rank, in the same words as the
  local backend's (run on both here).
- An inference worker's weight-update steps run one at a time on a Ray actor that serves calls on a pool of threads
  (`max_concurrency`, the request API): an `abort_weight_update` sent while a receive still runs waits for it, then
  puts back the old weights. Run beside it, the abort restored the old weights and the bucket landing afterwards was
  written into them (a mix, served under the old version).
- Restarts of a restartable group: its restart hooks run once per restart, in order; a hook that fails is raised
  (noted with role, ranks, hook and cause) and its unrestored successor stopped, so the next call restarts and
  restores it again (it was kept and served calls unrestored); a call from another thread to a rank being restored
  waits for its hooks (it reached the unrestored successor); a method that raises a RayActorError of its own (an
  actor it called died) fails the call with its error and restarts nothing (it was taken for its worker's death).
- A restart whose new worker fails to start (its constructor raises, or hangs past `start_timeout_s`) counts against
  `max_restarts`: once spent, a call fails at once naming the role, rank, attempts and the last start failure (each
  call tried again, for ever, waiting up to `start_timeout_s`). A rank that dies again while a restart hook restores
  it is restarted and restored inside the hook, and the caller's call is rerun (it failed, the group healthy).

One Ray instance for the module (`ray_session`); workers live in ray_call_workers.py, which Ray workers import.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from roll_core.cluster.group import RayOptions, WorkerDiedError, WorkerGroup
from roll_core.cluster.infer_role import InferWorker

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the controller imports the workers as Ray workers do (the fixture's PYTHONPATH)
from ray_call_workers import BlockingReceiver, Flaky, Restorable, RowMissing, Unstartable  # noqa: E402

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


class RestorableGroup(WorkerGroup[Restorable]):
    worker_cls = Restorable
    restartable = True


def _restorable(tmp_path: Path, max_restarts: int) -> RestorableGroup:
    return RestorableGroup(
        Restorable,
        2,
        "ray",
        name="restorable",
        ray_options=RayOptions(num_cpus=0.1),
        max_restarts=max_restarts,
        marker=str(tmp_path / "died"),
    )


def test_a_failed_restore_hook_is_raised_and_its_unrestored_successor_is_restarted_by_the_next_call(
    ray_session: Any, tmp_path: Path
) -> None:
    group = _restorable(tmp_path, max_restarts=2)
    ran: list[tuple[str, list[int]]] = []

    def reload(ranks: list[int]) -> None:
        ran.append(("reload", ranks))
        if len(ran) == 1:
            raise ConnectionError("the trainer could not publish its weights")
        group.call_ranks(ranks, Restorable.mark_restored)

    def resync(ranks: list[int]) -> None:
        ran.append(("resync", ranks))

    group.add_restart_hook(reload)
    group.add_restart_hook(resync)
    try:
        with pytest.raises(ConnectionError, match="could not publish") as raised:
            group.call(Restorable.die)
        notes = " ".join(getattr(raised.value, "__notes__", []))
        assert "restorable: rank(s) [0] were restarted (rank 0 died during die()" in notes, notes
        assert "restart hook test_a_failed_restore_hook" in notes and "reload failed to restore them" in notes, notes
        assert ran == [("reload", [0])]  # the failed hook stopped the restore: the next hook did not run
        # The successor that was not restored is not served: the call restarts rank 0 again and its hooks run again,
        # in order, once each; it answered False (kept, unrestored) with the restart count still 1.
        assert group.call(Restorable.restored) == [True, True]
        assert ran == [("reload", [0]), ("reload", [0]), ("resync", [0])]
        assert group.restarts == 2
    finally:
        group.shutdown()


def test_a_call_from_another_thread_waits_until_the_restored_rank_is_restored(ray_session: Any, tmp_path: Path) -> None:
    group = _restorable(tmp_path, max_restarts=1)
    restoring, release = threading.Event(), threading.Event()

    def reload(ranks: list[int]) -> None:
        restoring.set()
        assert release.wait(120), "the test never released the restore"
        group.call_ranks(ranks, Restorable.mark_restored)

    group.add_restart_hook(reload)
    seen: list[list[bool]] = []
    errors: list[BaseException] = []

    def run(fn: Any) -> threading.Thread:
        def target() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    try:
        dying = run(lambda: group.call(Restorable.die))
        assert restoring.wait(120), "rank 0 was never restarted"
        asking = run(lambda: seen.append(group.call(Restorable.restored)))
        # While the hook restores rank 0, the other thread's call waits for it (it got [False, True] at once).
        asking.join(timeout=3.0)
        assert asking.is_alive() and not seen, seen
        release.set()
        dying.join(timeout=120)
        asking.join(timeout=120)
        assert not errors, errors
        assert seen == [[True, True]] and group.restarts == 1
    finally:
        release.set()
        group.shutdown()


def test_a_method_raising_a_ray_actor_error_of_its_own_fails_the_call_and_restarts_nothing(
    ray_session: Any, tmp_path: Path
) -> None:
    ray = ray_session
    group = _restorable(tmp_path, max_restarts=2)
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            group.call(Restorable.raise_actor_error)
        notes = getattr(raised.value, "__notes__", [])
        assert [n for n in notes if n.startswith("restorable.raise_actor_error() raised on rank(s)")], notes
        # The workers were healthy: nothing restarted (they were, twice, and the call failed as a death).
        assert group.restarts == 0
        assert group.call(Restorable.restored) == [True, True]
    finally:
        group.shutdown()


def test_an_explicit_restart_spends_the_fault_budget_and_past_it_raises_restarting_nothing(
    ray_session: Any, tmp_path: Path
) -> None:
    """`group.restart()` (a health check, another caller's repair) ignored `max_restarts`: it restarted past the
    budget the fault path honours. It now spends that budget, and past it raises, killing no worker."""
    group = _restorable(tmp_path, max_restarts=1)
    try:
        group.restart([1], "a health check asked")
        assert group.restarts == 1
        pids = [p for _, _, p in group.call(Restorable.ping)]
        with pytest.raises(RuntimeError, match=r"1 restart\(s\) already, cluster.max_restarts=1"):
            group.restart([0], "asked again")
        assert group.restarts == 1
        assert [p for _, _, p in group.call(Restorable.ping)] == pids  # both workers kept
    finally:
        group.shutdown()


class UnstartableGroup(WorkerGroup[Unstartable]):
    worker_cls = Unstartable
    restartable = True


@pytest.mark.parametrize("hang", [False, True], ids=["constructor-raises", "start-times-out"])
def test_restarts_whose_worker_fails_to_start_spend_the_budget_then_calls_fail_at_once_naming_why(
    ray_session: Any, tmp_path: Path, hang: bool
) -> None:
    group = UnstartableGroup(
        Unstartable,
        2,
        "ray",
        name="unstartable",
        ray_options=RayOptions(num_cpus=0.1),
        max_restarts=2,
        marker=str(tmp_path / "died"),
        hang=hang,
    )
    # Set after the group's own start (a loaded machine may take longer): a hanging successor is given up on after a
    # few seconds; one whose constructor raises is given time to start (a worker process may take seconds to start).
    group.start_timeout_s = 3.0 if hang else 120.0
    starts = tmp_path / "died.starts"
    try:
        # Two calls, two attempts: each fails its call and spends one restart.
        for used, call in [(1, Restorable.die), (2, Restorable.restored)]:
            with pytest.raises(WorkerDiedError, match=r"rank\(s\) \[0\] could not be restarted") as raised:
                group.call(call)
            assert group.restarts == used
            assert f"{used} of cluster.max_restarts=2 restart(s) used" in str(raised.value)
        attempts = len(starts.read_text().splitlines()) if starts.exists() else 0
        # Budget spent: the next calls fail at once, trying no start (each tried again, waiting start_timeout_s).
        for _ in range(2):
            with pytest.raises(WorkerDiedError) as raised:
                group.call(Restorable.restored)
            message = str(raised.value)
            assert message.startswith("unstartable rank 0 on node "), message
            assert "2 restart(s) already, cluster.max_restarts=2" in message, message
            assert "Rank 0 failed to start in its last 2 restart attempt(s); the last failure: " in message, message
            if hang:
                assert "not up within 3.0s (GetTimeoutError)" in message, message
            else:
                assert "no GPU is visible to this worker" in message, message
                assert raised.value.__cause__ is not None and "no GPU" in str(raised.value.__cause__)
        assert group.restarts == 2
        assert (len(starts.read_text().splitlines()) if starts.exists() else 0) == attempts
        if not hang:
            assert attempts == 2  # each attempt built one successor, and none after the budget
    finally:
        group.shutdown()


def test_a_rank_that_dies_again_during_its_restore_is_restored_inside_it_and_the_call_succeeds(
    ray_session: Any, tmp_path: Path
) -> None:
    group = _restorable(tmp_path, max_restarts=2)
    ran: list[list[int]] = []

    def reload(ranks: list[int]) -> None:
        # As WeightSync.restore: retry=False steps; the first successor dies in `receive`, and is restarted and
        # restored by a restart inside this hook, whose own call then fails (WorkerRestartedError).
        ran.append(ranks)
        group.call_ranks(ranks, Restorable.receive)
        group.call_ranks(ranks, Restorable.mark_restored)

    group.add_restart_hook(reload)
    try:
        # Rank 0 dies, its successor dies in the restore, the next one is restored: the call is rerun there.
        assert group.call(Restorable.die) == [0, 1]
        assert ran == [[0], [0]] and group.restarts == 2
        assert group.call(Restorable.restored) == [True, True]
    finally:
        group.shutdown()
