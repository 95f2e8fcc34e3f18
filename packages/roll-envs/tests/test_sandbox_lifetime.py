"""How long a run's processes live: none outlives a roll process killed with SIGKILL (bwrap's --die-with-parent;
the unsandboxed child's own parent-death signal), and an unsandboxed run gets a run cgroup like a sandboxed one
(its process cap, where the kernel ignores RLIMIT_NPROC for root, and its cleanup of what the run left behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from roll_core.testing.processes import process_gone
from roll_envs.sandbox import PythonSandbox, SandboxLimits, cgroup

# The "roll process": builds a sandbox, starts a program that sleeps in a run thread, says so, then waits.
PARENT = """
import sys, threading, time
from roll_envs.sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError
try:
    sandbox = PythonSandbox(SandboxLimits(timeout_s=120), unsandboxed=sys.argv[1] == "unsandboxed")
except SandboxUnavailableError as exc:
    print("unavailable:", exc, flush=True)
    sys.exit(0)
threading.Thread(target=sandbox.run, args=("import time\\ntime.sleep(100)\\n",), daemon=True).start()
print("started", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["unsandboxed", "bwrap"])
def test_no_program_outlives_a_killed_parent(mode: str, program_pids: Callable[[int], list[int]]) -> None:
    """The trainer is SIGKILLed mid-run: its program is gone within seconds (the unsandboxed one slept on for its
    whole 100 s, out of reach of every cleanup: it is in no cgroup and left roll's process group)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    programs: list[int] = []
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        if line.startswith("unavailable:"):
            pytest.skip(f"no working {mode} sandbox here: {line}")
        assert line.strip() == "started", line
        deadline = time.monotonic() + 60
        while not programs:
            assert time.monotonic() < deadline, "the program never started"
            time.sleep(0.05)
            programs = program_pids(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30  # slack for a loaded machine (unreached, it sleeps 100 s)
        while not all(map(process_gone, programs)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(map(process_gone, programs)), f"{mode} programs {programs} outlived their killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in programs:
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
        if cgroup.available():
            cgroup.sweep_stale.__wrapped__()  # the dead parent's run cgroup


FORKS = """
import os, subprocess, time
quiet = subprocess.DEVNULL
background = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=quiet, stderr=quiet)
print(background.pid)
forked = 0
try:
    for _ in range(20):
        if os.fork() == 0:
            os.close(1)
            os.close(2)
            time.sleep(3)
            os._exit(0)
        forked += 1
except OSError:
    pass
print(forked)
"""


def test_an_unsandboxed_run_is_capped_and_cleaned_up_by_a_run_cgroup(caplog: pytest.LogCaptureFixture) -> None:
    """Without bwrap the run still gets a cgroup where one can be made: its processes are capped for the run (as
    root, where RLIMIT_NPROC is never enforced, the program forked all 20 children), and a process it left behind
    in a session of its own is killed with the run (it slept on for 300 s)."""
    if not cgroup.available():
        pytest.skip("no writable cgroup here (v2 with memory+pids, or v1 memory and pids)")
    sandbox = PythonSandbox(SandboxLimits(timeout_s=30, max_processes=4), unsandboxed=True)
    result = sandbox.run(FORKS)
    assert result.ok, result
    background, forked = map(int, result.stdout.split())
    try:
        # pids.max = max_processes + 3: the program itself and `sleep` leave 5 for its children.
        assert forked <= 5, f"forked {forked} children with max_processes=4"
        deadline = time.monotonic() + 30  # slack for a loaded machine (left behind, it sleeps 300 s)
        while not process_gone(background) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(background), "a process the run left behind outlived it"
    finally:
        if not process_gone(background):
            os.kill(background, signal.SIGKILL)
