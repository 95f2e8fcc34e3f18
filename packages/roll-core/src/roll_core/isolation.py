"""Run code that may hang in a forked child process, under a deadline: the child can be killed, a thread cannot.

`ForkedWorker(fn)` forks a child on the first call; the child inherits `fn` (and everything it references) from
the parent, so only arguments and results cross the pipe (they must pickle). The child serves one call at a time
for as long as it lives, in its own main thread (where signal-based timeouts such as math-verify's work).

Contract of `call(*args, timeout=s)`:
- returns `fn(*args)`;
- raises `ChildError` (with the child's exception type, message and traceback text) when `fn` raised;
- raises `CallTimeout` when no answer came within `s` seconds: the child is killed (SIGKILL), and the next call
  forks a fresh one from the parent as it is then;
- raises `ChildDied` when the child died during the call (a segfault, `os._exit`, the OOM killer).
Calls from several threads are serialised (one child, one call at a time). The child exits when the parent's end
of the pipe closes (the parent died or `close()` was called). On Linux it is also SIGKILLed by the kernel when
the parent process dies, even in the middle of a hung call (PR_SET_PDEATHSIG): a trainer killed with SIGKILL
leaves no child spinning on. That signal fires when the *thread* that forked the child ends: a child whose forking
thread has ended (an environment thread that finished) is replaced by a fresh one at the next call, never counted
as a failure. Children are forked by the calling thread itself: a fork from another thread (a process-long forker)
deletes the calling thread's state in the child, and its thread-local objects' destructors then ran there (a
torch DTensor sharding cache holding a gloo process group deadlocked the child in its destructor). The other
threads' states are deleted in the child all the same (CPython clears them: their `threading.local` values, their
`contextvars` context, their exception state), so every object the collector tracks is held across the fork
(`_held_across_fork`): no destructor of an object the parent's other threads owned runs in the child.

May assume: the parent is a POSIX process. Must not be used for `fn` that needs a CUDA context created before
the fork, Ray calls, or threads the parent started (a forked child has none of them).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe
from typing import Any, NoReturn


class CallTimeout(TimeoutError):
    """The child did not answer in time (it was killed)."""


class ChildDied(RuntimeError):
    """The child process died during a call."""


class ChildError(RuntimeError):
    """`fn` raised in the child; `kind` is the exception's type name, `details` its formatted traceback."""

    def __init__(self, kind: str, message: str, details: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.details = kind, details


def _serve(fn: Callable[..., Any], conn: Connection) -> None:
    """The child's loop: receive arguments, answer ("ok", result) or ("err", type, message, traceback)."""
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):  # the parent closed its end or died
            return
        try:
            reply: tuple[Any, ...] = ("ok", fn(*args))
        except BaseException as exc:  # everything fn does wrong is the caller's to count, never the child's end
            reply = ("err", type(exc).__name__, str(exc), traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result: report it as fn's error rather than hang the caller
            conn.send(("err", type(exc).__name__, f"result could not be sent to the parent: {exc}", ""))


def _kill(pid: int) -> None:
    """SIGKILL and reap `pid` (no zombie is left behind)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _exit_status(pid: int | None, wait_s: float = 1.0) -> str:
    """How child `pid` ended ("killed by SIGSEGV", "exit code 1"), reaping it; "still running" if it has not
    within `wait_s` (its end of the pipe closed first)."""
    if pid is None:
        return "unknown"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "already reaped"
        if done:
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                return f"killed by {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
            return f"exit code {os.waitstatus_to_exitcode(status)}"
        if time.monotonic() > deadline:
            return "still running"
        time.sleep(0.01)


_PR_SET_PDEATHSIG = 1


@functools.lru_cache(maxsize=1)
def _prctl() -> Callable[..., int] | None:
    """libc's prctl (Linux), looked up in the parent so a child only calls it; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent(parent: int) -> None:
    """In a forked child: SIGKILL when the forking thread ends (the whole parent with it); leave at once if the
    parent died before the request could be made."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def _held_across_fork() -> list[object]:
    """Every object the garbage collector tracks, to be held across a fork. A forked child keeps only the forking
    thread: CPython clears the other threads' states in it (`PyThreadState_Clear`), which releases what only they
    referenced (their `threading.local` values, their `contextvars` context, an exception being handled) and runs
    those objects' destructors there. A gloo process group's destructor joins threads the child does not have: a child
    forked from an environment thread while the main thread held one (a torch DTensor sharding cache in a
    thread-local) hung before serving, and so did one whose main thread's context variable held a value with a
    blocking destructor; every call timed out. Containers of such values (a `threading.local`'s per-thread dicts, a
    `contextvars.Context`) are tracked, so held by the forking thread they are never released in the child. Listing
    them all is cheaper than picking them out: ~17 ms for 240k objects (~57 ms to pick the thread-locals alone)."""
    import gc

    return gc.get_objects()


class ForkedWorker:
    """`fn` served by a forked child process; see the module docstring for the contract."""

    def __init__(self, fn: Callable[..., Any], name: str = "forked-worker") -> None:
        self.fn, self.name = fn, name
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._pid: int | None = None
        self._finalizer: weakref.finalize | None = None
        self._forked_by: threading.Thread | None = None  # the thread that forked the child (its death kills it)
        self._owner = os.getpid()  # the process whose child this is (a copy inherited by a fork is not ours)
        #: Children forked so far (the first one, then one after each timeout or death).
        self.forks = 0

    def _start(self) -> None:
        parent, child = Pipe()
        for stream in (sys.stdout, sys.stderr):  # buffered output would otherwise be written again by the child
            try:
                stream.flush()
            except Exception:
                pass
        fn, me = self.fn, os.getpid()
        _prctl()  # looked up here, not in the child

        def child_main() -> NoReturn:  # the child: serve, then leave without running the parent's exit handlers
            code = 0
            try:
                _die_with_parent(me)
                # A terminal's Ctrl-C reaches the whole foreground process group, a scheduler's SIGTERM often the
                # job's: the child inherited the trainer's handlers (a KeyboardInterrupt, or the graceful stop's
                # warning printed again by every child), so the stopped step's rewards died as failures. The parent
                # ends its children itself (deadline kills, the parent-death signal).
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_IGN)
                parent.close()
                torch = sys.modules.get("torch")
                if torch is not None:  # as torch's DataLoader workers do: no thread pool inherited mid-state
                    torch.set_num_threads(1)
                _serve(fn, child)
            except BaseException:
                code = 1
            finally:
                os._exit(code)

        kept = _held_across_fork()  # referenced by this frame in the child until it exits
        try:
            with warnings.catch_warnings():
                # Python >= 3.12 warns that forking a multi-threaded process may deadlock the child: a child stuck on
                # a lock some parent thread held is exactly what the caller's deadline kills and counts.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except BaseException:
            parent.close()
            child.close()
            raise
        if pid == 0:
            child_main()  # never returns
        del kept
        child.close()
        self._forked_by = threading.current_thread()
        self._conn, self._pid = parent, pid
        self.forks += 1
        self._finalizer = weakref.finalize(self, _close, parent, pid, self._owner)

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # closes the pipe, kills and reaps the child
        self._conn = self._pid = self._finalizer = None

    def call(self, *args: Any, timeout: float | None) -> Any:
        """`fn(*args)` in the child, waiting at most `timeout` seconds (None: no limit)."""
        if self._owner != os.getpid():
            # This object was copied into a forked process (a reward forked by another ForkedWorker): the child and
            # the lock belong to the parent. Forget them, without killing anything, and fork our own child.
            if self._finalizer is not None:
                self._finalizer.detach()
            self._lock, self._conn, self._pid, self._finalizer = threading.Lock(), None, None, None
            self._owner = os.getpid()
        with self._lock:
            if self._conn is not None and self._forked_by is not None and not self._forked_by.is_alive():
                self._stop()  # its forking thread ended, so its parent-death signal killed it: not a failure
            if self._conn is None:
                self._start()
            assert self._conn is not None
            try:
                self._conn.send(args)
            except (BrokenPipeError, OSError) as exc:  # the child died between calls
                self._stop()
                raise ChildDied(f"{self.name}: the child process is gone ({exc})") from exc
            t0 = time.monotonic()
            try:
                ready = self._conn.poll(timeout)
            except (EOFError, OSError):
                ready = True  # recv below reports the death
            if not ready:
                self._stop()
                raise CallTimeout(f"{self.name}: no answer within {timeout}s (child killed)")
            try:
                reply = self._conn.recv()
            except (EOFError, OSError) as exc:
                took = time.monotonic() - t0
                how = _exit_status(self._pid)  # before _stop reaps it: a signal says segfault, OOM killer, ...
                self._stop()
                raise ChildDied(f"{self.name}: the child process died ({how}) after {took:.1f}s of a call") from exc
        if reply[0] == "ok":
            return reply[1]
        raise ChildError(*reply[1:])

    def close(self) -> None:
        """Stop the child (a later call forks a new one)."""
        with self._lock:
            self._stop()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a reward shipped to a Ray actor): the function travels, the child and the lock do not."""
        return {"fn": self.fn, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["fn"], state["name"])  # type: ignore[misc]


def _close(conn: Connection, pid: int, owner: int) -> None:
    if os.getpid() != owner:  # a copy inherited by a forked process: the child is not this process's to kill
        return
    conn.close()
    _kill(pid)
