"""A backend's calls to its service run off the training thread: `SerialWorker` runs them one at a time, in order.

A tracker that talks to a server (MLflow) must not hold the training loop while the server is slow or away: a hung
server costs each request its whole timeout, and the client library's own retries multiply it (~47 s at MLflow's
first failure with roll's bounds, minutes with its defaults). The backend keeps its state as before and submits its
calls here; only the worker thread touches that state after construction, so nothing else needs a lock.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class SerialWorker:
    """A daemon thread that runs submitted calls one at a time, in the order submitted.

    Errors: the first exception a call raises is kept and raised to the caller by its next `submit`, `wait` or
    `finish` (with the call's traceback); the calls queued behind the failed one are skipped until then (the
    caller learns of the first failure, not of its consequences), and later ones run again. A process that exits
    without `finish` drops the calls not yet run (the daemon thread ends with it).
    """

    def __init__(self, name: str) -> None:
        # (call or None, args, run even after a failure, event set when done, stop the thread after it)
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any] | None, tuple[Any, ...], bool, Any, bool]]
        self._calls = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            call, args, always, done, stop = self._calls.get()
            try:
                if call is not None and (always or self._error is None):
                    call(*args)
            except BaseException as exc:  # kept for the caller: a worker thread has no one else to tell
                with self._lock:
                    self._error = self._error or exc
            finally:
                if done is not None:
                    done.set()
            if stop:
                return

    def _raise(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def submit(self, call: Callable[..., Any], *args: Any) -> None:
        """Queue `call(*args)` (returns at once); first raise the error of an earlier call, if any."""
        if not self._thread.is_alive():
            raise RuntimeError(f"{self._thread.name}: used after finish()")
        self._raise()
        self._calls.put((call, args, False, None, False))

    def wait(self) -> None:
        """Block until every call submitted so far has run; raise the error of one of them, if any."""
        done = threading.Event()
        self._calls.put((None, (), False, done, False))
        done.wait()
        self._raise()

    def finish(self, call: Callable[..., Any], *args: Any) -> None:
        """Run `call(*args)` after every submitted call (even after a failed one: it is the backend's close), stop
        the thread, then raise the first error (an earlier call's, else this one's)."""
        self._calls.put((call, args, True, None, True))
        self._thread.join()
        self._raise()


def schedule_retry(tracker: Any, exc: BaseException, base_s: float, max_s: float) -> float | None:
    """Count a failed connection on `tracker` (its `failures` and `retry_at`) and return the wait before the next
    try (`base_s` doubling per failure up to `max_s`) the first time, None after: the caller warns once, naming
    `describe_failure(exc)` and that wait."""
    import time

    tracker.failures += 1
    wait = min(base_s * 2 ** (tracker.failures - 1), max_s)
    tracker.retry_at = time.monotonic() + wait
    return wait if tracker.failures == 1 else None


def describe_failure(exc: BaseException) -> str:
    """The first line of an error as a warning shows it: credentials redacted, at most 300 characters."""
    from roll_core.tracking import redact_text

    return redact_text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)[:300]
