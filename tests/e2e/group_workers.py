"""Workers for tests/e2e/test_group_ray.py: one whose start fails on one rank (in the constructor, or in set-up while
the other ranks wait for it as in a rendezvous), one that changes its arguments in place. A module of its own: Ray
workers import it."""

from __future__ import annotations

import time

from roll_core.cluster.worker import Dispatch, Worker, dispatch


class FailsToStart(Worker):
    """Rank `fail_rank` raises while it is built (`where="init"`) or set up (`where="setup"`); the other ranks'
    set-up waits `wait_s` (a rendezvous with the rank that failed)."""

    def __init__(self, fail_rank: int, where: str, wait_s: float = 0.0, **base) -> None:
        super().__init__(**base)
        self.fail_rank, self.where, self.wait_s = fail_rank, where, wait_s
        if where == "init" and self.rank == fail_rank:
            raise RuntimeError(f"the engine of rank {self.rank} could not be built")

    def on_setup(self) -> None:
        if self.where == "setup" and self.rank == self.fail_rank:
            raise RuntimeError(f"the engine of rank {self.rank} could not be set up")
        time.sleep(self.wait_s)

    @dispatch(Dispatch.BROADCAST)
    def hello(self) -> int:
        return self.rank


class Mutator(Worker):
    """Changes what it is given in place, keeps what it was given, and returns its own buffer."""

    def __init__(self, **base) -> None:
        import torch

        super().__init__(**base)
        self.buffer = torch.zeros(3)
        self.kept: dict | None = None

    @dispatch(Dispatch.BROADCAST)
    def bump(self, batch, extra: dict) -> list[float]:
        seen = batch["x"].tolist()
        batch["x"].add_(1)
        batch.meta["touched_by"] = self.rank
        batch["ids"][0].append(99)
        extra["t"].mul_(0)
        return seen

    @dispatch(Dispatch.RANK0)
    def keep(self, state: dict) -> None:
        self.kept = state

    @dispatch(Dispatch.RANK0)
    def kept_sum(self) -> float:
        return float(self.kept["t"].sum())

    @dispatch(Dispatch.RANK0)
    def own_buffer(self):
        return self.buffer

    @dispatch(Dispatch.RANK0)
    def buffer_sum(self) -> float:
        return float(self.buffer.sum())


class Phoenix(Worker):
    """A worker that dies in `die()` (leaving a marker file) and whose successor cannot be set up."""

    def __init__(self, marker: str, **base) -> None:
        super().__init__(**base)
        self.marker = marker

    def on_setup(self) -> None:
        import os

        if os.path.exists(self.marker):
            raise RuntimeError("the engine cannot be rebuilt")

    @dispatch(Dispatch.BROADCAST)
    def die(self) -> int:
        import os

        if self.rank == 0:
            with open(self.marker, "w") as f:
                f.write("died")
            os._exit(1)
        return self.rank
