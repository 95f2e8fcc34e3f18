"""Mesh-aware dispatch: data splits by data-parallel rank; one result per replica, from the rank that holds it."""

from __future__ import annotations

import os

import pytest
import torch

from roll_core.cluster.group import WorkerGroup
from roll_core.cluster.mesh import Mesh
from roll_core.cluster.worker import Dispatch, Worker, dispatch
from roll_core.protocol import Batch


class Recorder(Worker):
    """Returns the rows it received, tagged with its rank (as a model replica's last stage would)."""

    @dispatch(Dispatch.DP)
    def echo(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)})

    @dispatch(Dispatch.BROADCAST)
    def rank_env(self) -> tuple[int, str | None]:
        return self.rank, os.environ.get("RANK")


def test_mesh_coordinates_follow_megatron_order() -> None:
    mesh = Mesh(dp=2, tp=2, pp=2)  # ranks: tp fastest, then dp, then pp
    assert [mesh.coords(r) for r in range(8)] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (1, 0, 0, 0),
        (1, 0, 0, 1),
        (0, 1, 0, 0),
        (0, 1, 0, 1),
        (1, 1, 0, 0),
        (1, 1, 0, 1),
    ]
    assert mesh.output_ranks() == [4, 6]  # tp 0 of the last stage, replica 0 then 1
    assert Mesh.for_world(8, tp=2) == Mesh(dp=4, tp=2, pp=1)
    with pytest.raises(ValueError, match="not a multiple of tensor_parallel_size"):
        Mesh.for_world(6, tp=4)


def test_context_parallel_ranks_sit_between_tensor_and_data_parallel() -> None:
    mesh = Mesh.for_world(8, tp=2, cp=2)  # Megatron's tp-cp-dp-pp order: (dp, pp, cp, tp)
    assert mesh == Mesh(dp=2, tp=2, pp=1, cp=2)
    assert [mesh.coords(r) for r in range(8)] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 1, 0),
        (0, 0, 1, 1),
        (1, 0, 0, 0),
        (1, 0, 0, 1),
        (1, 0, 1, 0),
        (1, 0, 1, 1),
    ]
    assert mesh.output_ranks() == [0, 4]  # tp 0 and cp 0 of each replica
    with pytest.raises(ValueError, match="context_parallel_size = 2 x 1 x 3"):
        Mesh.for_world(8, tp=2, cp=3)


@pytest.mark.parametrize(("tp", "pp", "cp"), [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)])
def test_dp_calls_split_by_replica_and_gather_from_output_ranks(tp: int, pp: int, cp: int) -> None:
    mesh = Mesh(dp=2, tp=tp, pp=pp, cp=cp)
    group = WorkerGroup(Recorder, mesh.world_size, "local", mesh=mesh)
    batch = Batch({"x": torch.arange(5)})  # uneven: replica 0 gets 3 rows, replica 1 gets 2
    handle = group.submit(Recorder.echo, batch)
    per_replica = handle.values()
    assert len(per_replica) == 2
    assert [p["rank"].unique().tolist() for p in per_replica] == [[r] for r in mesh.output_ranks()]
    assert torch.equal(handle.result()["x"], batch["x"])  # every row once, in order
    assert len(group.call(Recorder.rank_env)) == mesh.world_size  # broadcasts still reach every rank


def test_mesh_must_cover_the_group() -> None:
    with pytest.raises(ValueError, match="has 4 ranks, the group 2"):
        WorkerGroup(Recorder, 2, "local", mesh=Mesh(dp=1, tp=4))
