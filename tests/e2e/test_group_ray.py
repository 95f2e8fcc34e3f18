"""Worker groups on Ray: a group whose start fails on one rank gives back everything its start took (every actor
of the group is killed: the ranks built before the failure held CPUs, devices and placement bundles, so a rerun in
the same Ray session waited for them forever; the placement group made for it is removed; the error names the rank
and quotes the worker's own error), and calls pass arguments and results by value on both backends (the local one
passed them by reference). One Ray instance for the module (the `ray_cluster` fixture)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from roll_core.cluster.group import RayOptions, WorkerDiedError, WorkerGroup

sys.path.insert(0, str(Path(__file__).parent))  # importable by Ray workers too (the fixture's PYTHONPATH)
from group_workers import FailsToStart, Mutator, Phoenix

pytestmark = pytest.mark.ray


def _live_actors(cls_name: str, expected: int = 0, wait_s: float = 60.0) -> list[str]:
    """Actors of `cls_name` not yet dead; kills are asynchronous, so this waits (bounded) for no more than
    `expected` of them to be left."""
    from ray._private import state

    deadline = time.monotonic() + wait_s
    while True:
        actors = state.actors().values()
        live = [a["ActorID"] for a in actors if a["ActorClassName"].endswith(cls_name) and a["State"] != "DEAD"]
        if len(live) <= expected or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


def _free_cpus(ray: Any, want: float, wait_s: float = 60.0) -> float:
    deadline = time.monotonic() + wait_s
    while (free := ray.available_resources().get("CPU", 0.0)) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


class FailsToStartGroup(WorkerGroup[FailsToStart]):
    worker_cls = FailsToStart


def test_a_role_that_fails_to_start_gives_back_the_placement_group_made_for_it(ray_cluster: Any) -> None:
    """Through `Cluster.group` (what a pipeline's roles use): the placement group made for the failed role is removed
    (in a Ray session that outlives the run, a notebook's or a joined cluster's, its bundles stayed reserved); one
    made earlier for a role that started is kept."""
    from ray.util.placement_group import placement_group_table

    from roll_core.cluster.launch import Cluster
    from roll_core.config.schema import ClusterConfig, HwConfig

    cluster = Cluster(
        ClusterConfig(backend="ray", placement="disaggregated", cpus_per_worker=1, placement_timeout_s=60),
        HwConfig(platform="cpu"),
    )
    try:
        kept = cluster.group(FailsToStartGroup, "critic", 1, fail_rank=-1, where="init")
        with pytest.raises(WorkerDiedError, match=r"actor_train: .*failed to start"):
            cluster.group(FailsToStartGroup, "actor_train", 2, fail_rank=1, where="init")
        assert list(cluster._pgs) == ["critic"]
        live = [g for g, t in placement_group_table().items() if t["state"] != "REMOVED"]
        assert live == [cluster._pgs["critic"][0].id.hex()]
        assert kept.call(FailsToStart.hello) == [0]
    finally:
        cluster.shutdown()
    assert _live_actors("FailsToStart") == []


@pytest.mark.parametrize("where", ["init", "setup"])
def test_a_rank_that_fails_to_start_takes_the_whole_group_down_and_a_rerun_is_placed(
    ray_cluster: Any, where: str
) -> None:
    """Rank 1 of 3 fails while it is built or set up (ranks 0 and 2 wait 300 s in set-up, as in a rendezvous with
    it): the error names rank 1 and quotes its error at once, every actor is gone, and a group as large starts
    again in the same Ray session (before the fix ranks 0 and 2 kept their CPUs and the rerun waited forever)."""
    ray = ray_cluster
    total = ray.cluster_resources()["CPU"]
    opts = RayOptions(num_cpus=total / 3)  # the group takes every CPU: a leaked rank leaves a rerun unplaceable
    t0 = time.monotonic()
    with pytest.raises((WorkerDiedError, RuntimeError)) as err:
        WorkerGroup(FailsToStart, 3, "ray", name="starter", ray_options=opts, fail_rank=1, where=where, wait_s=300)
    # 150 s: room for three actors' start on a loaded machine, half the 300 s a start that waits for set-up takes.
    assert time.monotonic() - t0 < 150, "the failed start waited for the ranks in set-up"
    assert _live_actors("FailsToStart") == []
    assert _free_cpus(ray, total) == total
    if where == "init":  # Ray reports a constructor's error as the actor's death, its traceback quoted
        assert isinstance(err.value, WorkerDiedError)
        assert "starter: rank 1 failed to start" in str(err.value)
        assert "the engine of rank 1 could not be built" in str(err.value)
    else:  # a set-up's error is the worker's own (its type kept: a ConfigError stays one), noted with the rank
        assert "the engine of rank 1 could not be set up" in str(err.value)
        assert any(n.startswith("starter: rank 1 on node") for n in getattr(err.value, "__notes__", []))
    group = WorkerGroup(
        FailsToStart, 3, "ray", name="starter", ray_options=opts, start_timeout_s=60, fail_rank=-1, where=where
    )
    try:
        assert group.call(FailsToStart.hello) == [0, 1, 2]
    finally:
        group.shutdown()


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_arguments_and_results_travel_by_value_on_both_backends(ray_cluster: Any, backend: str) -> None:
    """On Ray every rank gets its own copy of a call's arguments and the caller a copy of its results; the local
    backend passed them by reference (rank 1 saw rank 0's in-place change of the batch, the caller's batch, meta,
    rows and other tensors changed under it, a kept argument changed with the caller's, a returned buffer was the
    worker's own). Both backends now: each rank sees the batch as the caller passed it; neither the caller's batch,
    its meta and rows nor another argument changes; a kept argument and a returned buffer are the worker's own."""
    import torch

    from roll_core.protocol import Batch

    group = WorkerGroup(Mutator, 2, backend, name="mutator", ray_options=RayOptions(num_cpus=0.1))
    try:
        batch = Batch({"x": torch.zeros(3)}, {"ids": [[1], [2], [3]]}, {"step": 1})
        extra = {"t": torch.ones(2)}
        assert group.call(Mutator.bump, batch, extra) == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
        assert batch["x"].tolist() == [0.0, 0.0, 0.0] and extra["t"].tolist() == [1.0, 1.0]
        assert batch.meta == {"step": 1} and batch["ids"] == [[1], [2], [3]]
        state = {"t": torch.ones(2)}
        group.call(Mutator.keep, state)
        state["t"].add_(10)
        assert group.call(Mutator.kept_sum) == 2.0
        group.call(Mutator.own_buffer).add_(5)
        assert group.call(Mutator.buffer_sum) == 0.0
    finally:
        group.shutdown()


class PhoenixGroup(WorkerGroup[Phoenix]):
    worker_cls = Phoenix
    restartable = True


def test_a_successor_that_cannot_be_set_up_is_killed_and_the_restart_fails_clearly(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """Rank 0 dies in a call; its successor's set-up raises. The restart fails with a WorkerDiedError that quotes the
    successor's error and the death that called for the restart, and the successor is killed: it stayed alive,
    holding its CPUs (or bundle), and the error was the successor's raw set-up error, as if the call itself had
    raised it."""
    ray = ray_cluster
    total = ray.cluster_resources()["CPU"]
    group = PhoenixGroup(
        Phoenix,
        2,
        "ray",
        name="phoenix",
        ray_options=RayOptions(num_cpus=1),
        max_restarts=1,
        marker=str(tmp_path / "died"),
    )
    try:
        with pytest.raises(WorkerDiedError, match=r"phoenix: rank\(s\) \[0\] could not be restarted") as err:
            group.call(Phoenix.die)
        assert "the engine cannot be rebuilt" in str(err.value)
        # Why the restart was needed (the death and Ray's account of it) is kept: it was dropped.
        assert "The restart was for: rank 0 died during die() (" in str(err.value)
        assert len(_live_actors("Phoenix", expected=1)) == 1  # rank 1 alone
    finally:
        group.shutdown()
    assert _free_cpus(ray, total) == total
