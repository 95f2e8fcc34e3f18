"""How long a ForkedWorker's child lives: not past its parent process (even in the middle of a hung call), but
past the thread that happened to start it."""

from __future__ import annotations

import contextvars
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from roll_core.isolation import ForkedWorker
from roll_core.testing.processes import process_gone

# The "trainer": a reward child that hangs in its call (a sympy simplification that never ends), started from a
# worker thread as an environment thread would; the child writes its pid to argv[1] once it is in the call.
PARENT = """
import os, sys, threading, time
from roll_core.isolation import ForkedWorker

def hang(path):
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(120)

worker = ForkedWorker(hang)
threading.Thread(target=worker.call, args=(sys.argv[1],), kwargs={"timeout": None}, daemon=True).start()
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_killed_parent_even_in_a_hung_call(tmp_path: Path) -> None:
    """SIGKILL the parent while its child hangs in a call: the child is gone within seconds (it slept on for its
    whole 120 s: it only noticed the parent's death at its next read of the pipe)."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file)])
    child = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the child never started its call"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while not process_gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(child), "the child outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and not process_gone(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_whose_forking_thread_ended_is_replaced_without_an_error() -> None:
    """A parent-death signal fires when the forking *thread* ends: the child of an environment thread that finished
    is gone, and the next call (from any thread) gets a fresh child instead of a reward error."""
    worker = ForkedWorker(os.getpid, name="pid")
    first: list[int] = []
    starter = threading.Thread(target=lambda: first.append(worker.call(timeout=30)))
    starter.start()
    starter.join()
    deadline = time.monotonic() + 5
    while not process_gone(first[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert process_gone(first[0])  # the signal killed it with its thread
        second = worker.call(timeout=30)
        assert second not in (first[0], os.getpid()) and worker.forks == 2
    finally:
        worker.close()


def test_the_calling_threads_state_survives_in_the_child() -> None:
    """Children were forked by a process-long "forker" thread: the calling thread's state was then deleted in the
    child and its thread-local objects' destructors ran there (a torch DTensor sharding cache holding a gloo process
    group deadlocked the child: every reward call timed out). The child keeps the caller's thread-local state."""
    local = threading.local()
    local.value = "kept"
    worker = ForkedWorker(lambda: getattr(local, "value", "lost"), name="local")
    try:
        assert worker.call(timeout=30) == "kept"
    finally:
        worker.close()


def test_a_child_started_from_a_thread_has_a_main_thread_for_signals() -> None:
    """SIGALRM-based timeouts (math-verify's) need the child's thread to be its main thread, whichever thread forked."""

    def alarm_works() -> bool:
        signal.signal(signal.SIGALRM, lambda *_: None)
        signal.alarm(0)
        return threading.current_thread() is threading.main_thread()

    worker = ForkedWorker(alarm_works, name="alarm")
    out: list[bool] = []
    starter = threading.Thread(target=lambda: out.append(worker.call(timeout=30)))
    starter.start()
    starter.join()
    try:
        assert out == [True] and worker.call(timeout=30) is True
    finally:
        worker.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_group_leaves_the_child_serving(sig: signal.Signals) -> None:
    """Ctrl-C reaches every process of the terminal's foreground group (a scheduler's SIGTERM often the whole job):
    the trainer stops gracefully after its step, so its reward children must go on scoring that step. They died of
    the inherited KeyboardInterrupt, and the step's rewards became failures."""
    worker = ForkedWorker(os.getpid, name="pid")
    try:
        child = worker.call(timeout=30)
        os.kill(child, sig)
        time.sleep(0.3)  # a child that took the signal is gone by now
        assert not process_gone(child)
        assert worker.call(timeout=30) == child and worker.forks == 1
    finally:
        worker.close()


class _BlocksInAForkedChild:
    """Like a gloo process group: its destructor joins threads that a forked child does not have (here: blocks)."""

    def __init__(self) -> None:
        self.owner = os.getpid()

    def __del__(self) -> None:
        if os.getpid() != self.owner:
            time.sleep(60)


_CONTEXT_HELD = contextvars.ContextVar("held_by_the_main_thread")


@pytest.mark.parametrize("holder", ["thread_local", "context_var"])
def test_a_child_forked_from_a_thread_outlives_what_the_main_thread_holds(holder: str) -> None:
    """A child forked from an environment thread hung before serving when the main thread held an object whose
    destructor blocks in a child (a DTensor sharding cache's gloo process group, after an FSDP2 step): CPython
    clears the other threads' states in the child (their thread-local values, their contextvars context), which ran
    that destructor there. Every reward call timed out (seen in the suite under pytest-xdist, where an FSDP2 test ran
    before this module in the same process; the context-variable case in later xdist runs)."""
    local = threading.local()
    if holder == "thread_local":
        local.group = _BlocksInAForkedChild()  # held by the main thread only
    else:
        # No token kept: a Token references its Context, and a frame's locals outlive the fork (only the thread
        # states are cleared), which would keep the value alive in the child where a user's context has no token.
        _CONTEXT_HELD.set(_BlocksInAForkedChild())
    worker = ForkedWorker(os.getpid, name="pid")
    out: list[object] = []

    def call() -> None:
        try:
            out.append(worker.call(timeout=8))
        except Exception as exc:  # the test reports what the call raised
            out.append(exc)

    starter = threading.Thread(target=call)
    starter.start()
    starter.join()
    try:
        assert len(out) == 1 and isinstance(out[0], int) and out[0] != os.getpid(), out
    finally:
        worker.close()
        _CONTEXT_HELD.set(None)
        local.__dict__.clear()
