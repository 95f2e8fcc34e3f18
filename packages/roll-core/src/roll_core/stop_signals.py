"""The shared mechanics of roll's stop handlers (a run's steps, its build, roll-eval): SIGINT and SIGTERM routed to a
subclass's `_handle(signum, frame)` inside a `with` block, the handlers found first restored on exit.

Contract: `rearm()` (run by `__enter__`) installs `_handle` for both signals, from the main thread only (Python
delivers signals there; elsewhere it does nothing), and may run again after code that replaced the handlers (`ray.init`
installs its own SIGTERM handler): the handlers found the first time are the ones `__exit__` puts back. Imports only
the standard library, so the CLI's light paths can use it.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Base of a context manager whose `_handle` receives SIGINT/SIGTERM inside it (module docstring)."""

    def __init__(self) -> None:
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise NotImplementedError

    def rearm(self) -> None:
        """(Re)install the handlers; the ones found first are those restored on exit."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            old = signal.signal(sig, self._handle)
            self._old.setdefault(sig, old)

    def __enter__(self) -> Any:
        self.rearm()
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
