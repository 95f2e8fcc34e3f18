"""A call run on a thread of its own, for tests where one thread blocks (a trainer's `take`, a weight sync's wait) while
the test's thread acts on it (finishes requests, closes the driver, fails the engine). No pytest.

Contract: `InThread(fn)` starts `fn()` at once on a daemon thread (a call that never returns does not keep the test
process alive); once it ended, `result` holds what it returned or `error` what it raised (any BaseException, so a
failing call is reported to the test's thread instead of printed by the thread's excepthook). `join(timeout_s)` says
whether it ended within `timeout_s`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["InThread"]


class InThread:
    """`fn()` on a daemon thread, started at once (see the module docstring)."""

    def __init__(self, fn: Callable[[], Any], *, name: str = "roll-test-call") -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # reported to the test's thread
            self.error = exc

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds for the call to end; whether it ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Whether the call still runs."""
        return self._thread.is_alive()
