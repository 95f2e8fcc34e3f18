"""Workers for test_group_ray_calls.py, in a module of their own: Ray workers import it (the test module, imported by
pytest's importlib mode, is not importable by name).

- `Flaky`: a broadcast whose rank `fail_rank` raises its own error type (`RowMissing`), counting the calls each rank
  ran, so a test can see that every rank ran the call whatever another rank raised.
- `BlockingReceiver`: a real `InferWorker` (its weight-update steps and their lock, as a pipeline's engines run them)
  around `BlockingEngine`, whose receive blocks until the test releases it, and which logs every step in order.
- `Restorable`: rank 0's first incarnation dies in `die()` (a marker file says it died); a successor starts
  unrestored until a restart hook calls `mark_restored`; `raise_actor_error` raises a RayActorError of its own;
  `receive` (a restore's retry=False step) kills rank 0's first successor in it.
- `Unstartable`: a `Restorable` whose successors of rank 0 cannot start (the constructor raises, or hangs).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from roll_core.cluster.infer_role import InferWorker
from roll_core.cluster.worker import Dispatch, Worker, dispatch

#: How long a blocked receive waits for the test's release before it fails (a test that never releases it).
RELEASE_TIMEOUT_S = 120.0


class RowMissing(LookupError):
    """The failing rank's own error type: the caller must get this type, not only Ray's wrapper."""


class Flaky(Worker):
    """`fail_on` raises `RowMissing` on rank `fail_rank` and returns the rank elsewhere; `calls` counts them."""

    def __init__(self, fail_rank: int, **base: Any) -> None:
        super().__init__(**base)
        self.fail_rank, self.calls = fail_rank, 0

    @dispatch(Dispatch.BROADCAST)
    def fail_on(self, row: int) -> int:
        self.calls += 1
        if self.rank == self.fail_rank:
            raise RowMissing(f"rank {self.rank} has no row {row}")
        return self.rank

    @dispatch(Dispatch.BROADCAST)
    def called(self) -> int:
        """How many `fail_on` calls this rank ran (an actor serves one call at a time: this runs after them)."""
        return self.calls


class BlockingEngine:
    """An inference engine's weight-update side: one weight `w`; `update_weights` logs that it started, blocks until
    `release` is set, then writes the bucket; `abort_weight_update` puts back the weights `begin_weight_update` saw."""

    def __init__(self) -> None:
        self.weights: dict[str, float] = {"w": 0.0}
        self.version = 0
        self.steps: list[str] = []
        self.release = threading.Event()
        self._saved: dict[str, float] | None = None

    def begin_weight_update(self) -> None:
        self._saved = dict(self.weights)
        self.steps.append("begin")

    def update_weights(self, named: Iterable[tuple[str, Any]]) -> int:
        self.steps.append("receive started")
        if not self.release.wait(RELEASE_TIMEOUT_S):
            raise TimeoutError(f"the test did not release the receive within {RELEASE_TIMEOUT_S}s")
        count = 0
        for name, value in named:
            self.weights[name] = float(value)
            count += 1
        self.steps.append("receive ended")
        return count

    def finish_weight_update(self) -> int:
        self.version += 1
        self.steps.append("finish")
        return self.version

    def abort_weight_update(self, reason: str) -> int:
        assert self._saved is not None, "abort without begin"
        self.weights = dict(self._saved)
        self.steps.append("abort")
        return self.version


class BlockingReceiver(InferWorker):
    """An InferWorker whose engine is a `BlockingEngine` (no model: the steps and their lock are InferWorker's own).
    Its `abort_weight_update` logs the call's arrival before InferWorker's takes the weight-update lock."""

    def __init__(self, **base: Any) -> None:
        Worker.__init__(self, **base)  # not InferWorker's: there is no engine config to build
        self.engine = BlockingEngine()  # type: ignore[assignment]
        self._sync_group = None

    @dispatch(Dispatch.BROADCAST, retry=False)
    def abort_weight_update(self, reason: str) -> int:
        self.engine.steps.append("abort called")
        return super().abort_weight_update(reason)

    @dispatch(Dispatch.BROADCAST)
    def steps(self) -> list[str]:
        return list(self.engine.steps)

    @dispatch(Dispatch.BROADCAST)
    def release(self) -> None:
        self.engine.release.set()

    @dispatch(Dispatch.BROADCAST)
    def weights(self) -> dict[str, float]:
        return dict(self.engine.weights)


class Restorable(Worker):
    """Rank 0 dies in its first `die()` (leaving the `marker` file); a worker built after that (a successor) is
    unrestored until `mark_restored` (what a restart hook restores), which `restored` reports."""

    def __init__(self, marker: str, **base: Any) -> None:
        super().__init__(**base)
        self.marker = marker
        self.is_restored = not os.path.exists(marker)

    @dispatch(Dispatch.BROADCAST)
    def die(self) -> int:
        if self.rank == 0 and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os._exit(1)
        return self.rank

    @dispatch(Dispatch.BROADCAST)
    def mark_restored(self) -> None:
        self.is_restored = True

    @dispatch(Dispatch.BROADCAST)
    def restored(self) -> bool:
        return self.is_restored

    @dispatch(Dispatch.BROADCAST)
    def raise_actor_error(self) -> int:
        """Raises Ray's error for a dead actor as its own (what a method whose call to another actor failed does)."""
        import ray

        raise ray.exceptions.ActorDiedError()

    @dispatch(Dispatch.BROADCAST, retry=False)
    def receive(self) -> int:
        """A restore's step: rank 0's first successor dies in it (a `.receive` marker says one did)."""
        if self.rank == 0 and not os.path.exists(self.marker + ".receive"):
            with open(self.marker + ".receive", "w") as f:
                f.write(str(os.getpid()))
            os._exit(1)
        return self.rank


class Unstartable(Restorable):
    """Rank 0's successors (built once the `marker` file exists) cannot start: each appends a line to
    `marker.starts`, then raises (a worker without its GPU) or, with `hang`, sleeps past any start timeout."""

    def __init__(self, marker: str, hang: bool = False, **base: Any) -> None:
        super().__init__(marker, **base)
        if self.rank == 0 and os.path.exists(marker):
            with open(marker + ".starts", "a") as f:
                f.write(f"{os.getpid()}\n")
            if hang:
                time.sleep(3600)
            raise RuntimeError("no GPU is visible to this worker (CUDA_VISIBLE_DEVICES is empty)")
