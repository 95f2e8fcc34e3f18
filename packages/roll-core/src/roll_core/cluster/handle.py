"""A pending worker-group call: `Handle`, what `WorkerGroup.submit` returns (roll_core.cluster.group).

Contract:
- `values()` waits for every rank's part and returns the per-rank results (a DP call on a mesh: one per replica, in
  DP order). The first call resolves the parts (the group's resolver waits for them and, on Ray, repairs faults:
  restarts and reruns); its outcome is kept, so a later call returns the same results, or raises the same error,
  and never reruns anything.
- `result()` is `values()` assembled per the method's dispatch mode: rank 0's result (RANK0, ONE), the Batches
  concatenated (DP), else the list.
- `wait(timeout)` only says whether every part has ended; it neither raises nor repairs. On the local backend the
  call ran at submission, so it is always true.
- `refs` are the raw parts (Ray object refs, or the local results) to pass on without a round trip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from roll_core.cluster.worker import Dispatch
from roll_core.protocol import Batch

R = TypeVar("R")


class Handle(Generic[R]):
    """A pending group call of a method returning `R` on each rank; `values()` waits for the per-rank results,
    `result()` waits and assembles them per the dispatch mode."""

    def __init__(
        self,
        parts: list[Any],
        mode: Dispatch,
        resolve: Callable[[list[Any]], list[Any]],
        keep: list[int] | None = None,
        remote: bool = False,
    ) -> None:
        self._parts, self._mode, self._resolve, self._remote = parts, mode, resolve, remote
        self._keep = keep  # DP calls on a mesh: the parts that carry results (one per replica, in DP order)
        # The outcome of the first wait, kept: waiting again must not rerun parts that a restart already reran.
        self._outcome: tuple[bool, Any] | None = None

    @property
    def refs(self) -> list[Any]:
        """Raw per-rank results or Ray object refs (to pass results on without a round trip)."""
        return self._parts

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every rank's part has ended (with a result or an error) within `timeout` seconds; neither raises
        nor repairs faults (`values()` does). Always true on the local backend (calls ran at submission)."""
        if not self._remote or self._outcome is not None:
            return True
        import ray

        ready, _ = ray.wait(list(self._parts), num_returns=len(self._parts), timeout=timeout)
        return len(ready) == len(self._parts)

    def values(self) -> list[R]:
        """Per-rank results, waiting for every rank; a DP call on a mesh returns one result per replica. The first
        call waits (and repairs faults); later calls return its results, or raise its error, again."""
        if self._outcome is None:
            try:
                self._outcome = (True, self._resolve(self._parts))
            except Exception as exc:
                self._outcome = (False, exc)
                raise
        ok, values = self._outcome
        if not ok:
            raise values
        return values if self._keep is None else [values[i] for i in self._keep]

    def result(self) -> Any:
        values = self.values()
        if self._mode in (Dispatch.RANK0, Dispatch.ONE):
            return values[0]
        if self._mode is Dispatch.DP and values and all(isinstance(v, Batch) for v in values):
            return Batch.concat(values)
        return values
