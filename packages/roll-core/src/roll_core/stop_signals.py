"""The shared mechanics of roll's stop handlers (a run's steps, its build, roll-eval): SIGINT and SIGTERM routed to a
subclass's `_handle(signum, frame)` inside a `with` block, the handlers found first restored on exit.

Contract: `rearm()` (run by `__enter__`) installs `_handle` for both signals, from the main thread only (Python
delivers signals there; elsewhere it does nothing), and may run again after code that replaced the handlers (`ray.init`
installs its own SIGTERM handler): the handlers found the first time are the ones `__exit__` puts back. Imports only
the standard library, so the CLI's light paths can use it.

An exception `_handle` raises is never lost: Python runs a signal handler wherever the main thread is, also inside a
`__del__` or a weakref callback (torch and transformers run some while a model loads), where an exception is only
printed (`Exception ignored in ...`) and the code goes on. Inside the block `sys.unraisablehook` sees such an
exception of ours: it is not printed, and the same exception is raised again at the next point of the main thread
outside the hook (a thread delivers the signal once more then; the handler raises it without calling `_handle`, so
it counts once); so is one raised while the main thread is in that hook (passing another exception to the hook found
on entry). A stop signal while a model loaded was lost so (1 Ctrl-C in 8 here): the run trained every step and
exited 0. The thread delivers it to roll's handler only: while a library's handler is installed it waits (the
library would get a signal the user never sent, and the user's next one was taken for the delivery and ignored),
and delivers it once roll's handler is back (the library restored it, a subclass's `rearm()`); a subclass's own
check takes it meanwhile (BuildStop.check, run by its `rearm()` and at the build's end), as does the next signal
roll's handler gets. One still kept when the block ends without an error is logged (a warning), not raised: what it
would have stopped is over. Where a subclass defers a signal (`_defers`: BuildStop inside `ray.init`'s
connection), a kept stop delivered there waits too, as a first signal there does; a signal sent there is the next
one (a second aborts at once). After the block, roll's hook (a library that wrapped it meanwhile still calls it)
passes what it gets to the hook found on entry. A handler found on entry that was installed outside Python (which
Python cannot put back) is replaced by the default action on exit.

`exiting(program)` is for a process a stop signal already stopped, about to exit (its stop line printed): once Python
shuts down, a further SIGINT no longer raises KeyboardInterrupt into the shutdown (a second Ctrl-C there printed
`Exception ignored in atexit callback: <function _del_library ...>` and torch's traceback); it says once that the
process is exiting, and the next one kills it at once (Python's default action), as SIGTERM does: a hung exit can
still be killed.
"""

from __future__ import annotations

import _thread
import atexit
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

log = logging.getLogger(__name__)


class StopSignals:
    """Base of a context manager whose `_handle` receives SIGINT/SIGTERM inside it (module docstring)."""

    def __init__(self) -> None:
        self._old: dict[int, Any] = {}
        # The exception the last signal raised (and its signal) until the block ends; a lost one waiting to be raised.
        self._raised: tuple[BaseException, int] | None = None
        self._lost: BaseException | None = None
        # The hook found on entry: kept after the block, where a library's wrapper may still call ours.
        self._hook: Any = None
        # `_lost` is taken under it: by the resend thread (which then delivers the signal once more) or by a caller
        # raising the stop itself (`take_lost`), never both; `_resent` marks the delivery the thread made.
        self._lost_lock = threading.RLock()  # reentrant: the handler may run in the main thread while it holds it
        self._resent = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise NotImplementedError

    def _defers(self, frame: FrameType | None) -> bool:
        """Whether a stop raised at `frame` must wait (the subclass raises it later itself); none here."""
        return False

    def _dispatch(self, signum: int, frame: FrameType | None) -> None:
        """The installed handler: `_handle`, remembering what it raises; a lost exception is raised again instead."""
        resent, self._resent = self._resent, False
        if self._lost is not None:
            if _inside(frame, _HOOK):  # not in the hook: Python would drop it there too
                self._start_resend(signum)
                return
            if self._defers(frame):
                if resent:  # kept, as a first signal here is: the subclass raises it later
                    return
                # A signal sent here is the next one (a second aborts): deferred too, no Ctrl-C ended a hung
                # `ray.init` connection. The kept stop goes (the abort replaces it).
                with self._lost_lock:
                    self._lost = None
            else:
                with self._lost_lock:
                    lost, self._lost = self._lost, None
                if lost is not None:
                    self._raised = (lost, signum)
                    raise lost.with_traceback(None)
        if resent:  # the thread's delivery of a stop the caller raised meanwhile (`take_lost`): not a new signal
            return
        try:
            self._handle(signum, frame)
        except BaseException as exc:
            if _inside(frame, _HOOK):  # raised out of the hook, Python would print and drop it: delivered again
                with self._lost_lock:
                    self._lost = exc
                self._start_resend(signum)
                return
            self._raised = (exc, signum)
            raise

    def _unraisable(self, info: Any) -> None:
        """sys.unraisablehook inside the block: our exception, swallowed where Python cannot raise it, is raised
        again (module docstring); anything else goes to the hook found on entry, also after the block (a library
        that wrapped this hook meanwhile still calls it)."""
        raised = self._raised
        if raised is None or info.exc_value is not raised[0]:
            (self._hook or sys.__unraisablehook__)(info)
            return
        self._raised, self._lost = None, raised[0]
        self._start_resend(raised[1])

    def _start_resend(self, signum: int) -> None:
        threading.Thread(
            target=self._resend, args=(signum, threading.main_thread().ident), daemon=True, name="roll-stop-resend"
        ).start()

    def _resend(self, signum: int, main: int | None) -> None:
        """Deliver `signum` to the main thread's handler once more (`_thread.interrupt_main`, as a signal arriving)
        as soon as the main thread is out of `_unraisable` (the handler would run in it, at its next check), unless
        the block ended or a signal raised the lost exception meanwhile. Only to roll's own handler: a library's would
        get a signal never sent, and `_resent` would stay set and swallow the user's next one; while one is installed
        the thread waits for roll's to be back (a subclass's `rearm()`, the library's restore; module docstring). A
        handler swapped after the delivery still gets it: signal.signal runs a pending one with the handler it
        replaces."""
        while self._lost is not None:
            with self._lost_lock:
                if self._lost is None:  # raised meanwhile (`take_lost`, a signal)
                    return
                ours = signal.getsignal(signum) == self._dispatch
                if ours and not _inside(sys._current_frames().get(main), _HOOK):
                    self._resent = True
                    _thread.interrupt_main(signum)
                    return
            # Giving up here lost the stop: an evaluation went on to its end after the user's Ctrl-C.
            time.sleep(0.001 if ours else 0.02)

    def take_lost(self) -> BaseException | None:
        """The swallowed exception waiting to be raised again, taken (the resend thread then delivers nothing): for
        a caller that raises the stop itself. None when there is none."""
        with self._lost_lock:
            lost, self._lost = self._lost, None
        return lost

    def rearm(self) -> None:
        """(Re)install the handlers; the ones found first are those restored on exit."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            old = signal.signal(sig, self._dispatch)
            self._old.setdefault(sig, old)

    def __enter__(self) -> Any:
        if threading.current_thread() is threading.main_thread():
            self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        self.rearm()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lost_lock:  # first: from here the thread delivers nothing (it would reach the caller's handler)
            kept, self._raised, self._lost = self._lost, None, None
        for sig, old in self._old.items():
            # None: a handler installed outside Python, which Python cannot put back (signal.signal(sig, None)
            # raised TypeError here, leaving roll's handler and hook installed and replacing the block's exception).
            signal.signal(sig, signal.SIG_DFL if old is None else old)
        self._old.clear()  # an instance entered again restores the handlers found then, not the first time's
        if self._hook is not None and sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._hook
        if kept is not None and exc[1] is None:
            # Not raised: what it would have stopped is over (roll-eval's models all evaluated, the run's wrap-up
            # done; raised now, finished work was reported as stopped); said, not silently dropped.
            log.warning(
                "a stop signal's %s, dropped by Python (raised in a __del__ or weakref callback), was not raised "
                "again before %s ended (another handler than roll's was installed meanwhile, or the block ended first)",
                type(kept).__name__,
                type(self).__name__,
            )


def exiting(program: str) -> None:
    """Before the exit of a process a stop signal stopped: from the start of Python's shutdown, the next SIGINT says
    the process is exiting and the one after kills it; SIGTERM kills it (module docstring). Installed when the
    shutdown starts (before the threads are joined and the atexit callbacks run), not now: a caller that catches
    the SystemExit and goes on (a test, a notebook) keeps its handlers."""
    register = getattr(threading, "_register_atexit", None)  # run before the threads are joined (Python >= 3.9)
    try:
        (register or atexit.register)(_install_exiting, program)
    except RuntimeError:  # the shutdown has started
        _install_exiting(program)


def _install_exiting(program: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        return

    def note(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:  # not print(): the main thread may be inside a write to sys.stderr (a reentrant call raises)
            os.write(2, f"{program}: the run is over, exiting (Ctrl-C again kills it now)\n".encode())
        except OSError:
            pass

    signal.signal(signal.SIGINT, note)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _inside(frame: FrameType | None, code: Any) -> bool:
    """Whether `frame` or a frame that called it runs `code`."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


_HOOK = StopSignals._unraisable.__code__
