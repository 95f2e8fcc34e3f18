"""The driver's lock (roll_core.scheduling.driver: `AsyncRollout._cv` is a `threading.Condition` over it): a reentrant
lock that knows which thread holds it, so that a `close` that cannot get it names the holder (a caller inside `held()`,
the rollout thread, the data thread: `_driver_timeouts.warn_lock_held`) instead of guessing.

Contract: `OwnedLock` behaves as `threading.RLock` (acquire with blocking and timeout, release, a context manager, and
the protocol `threading.Condition` uses: `_is_owned`, `_release_save`, `_acquire_restore`, so a `wait` releases every
level of the holder's and restores them after); `owner` is the thread that holds it, None while it is free or a holder
waits on the condition. Only the holder writes `owner`; anyone may read it without the lock (one attribute read: a
holder that lets go meanwhile reads as itself or None, never as a thread that did not hold it).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["OwnedLock"]


class OwnedLock:
    """A reentrant lock that records its holder in `owner` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # the holder's levels (written by the holder only)
        self.owner: threading.Thread | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As `threading.RLock.acquire`; on success the caller is `owner`."""
        if not self._lock.acquire(blocking, timeout):
            return False
        self._depth += 1
        self.owner = threading.current_thread()
        return True

    def release(self) -> None:
        """As `threading.RLock.release` (a thread that does not hold it gets its RuntimeError)."""
        if not self._lock._is_owned():  # type: ignore[attr-defined]
            self._lock.release()  # raises RLock's own error
        self._depth -= 1
        if self._depth == 0:
            self.owner = None
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ---- what threading.Condition calls (a wait lets go of every level, then takes them back) ----
    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined]

    def _release_save(self) -> tuple[int, Any]:
        depth, self._depth, self.owner = self._depth, 0, None
        return depth, self._lock._release_save()  # type: ignore[attr-defined]

    def _acquire_restore(self, state: tuple[int, Any]) -> None:
        depth, inner = state
        self._lock._acquire_restore(inner)  # type: ignore[attr-defined]
        self._depth, self.owner = depth, threading.current_thread()
