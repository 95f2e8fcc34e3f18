"""A cgroup per sandboxed run (roll_envs.sandbox.cgroup): memory split over many processes, each under its own
rlimit, is still capped for the run as a whole; the cgroup is gone after the run. Skips where no writable cgroup
exists (the runner then keeps per-process limits only and says so in the log)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_envs.sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError, cgroup, runner

# Six children of 300 MiB each (every one under the 400 MiB per-process limit): 1.8 GiB together. Each child
# writes its memory, holds it a moment and exits 0; the parent prints how each child ended.
SPREAD = """
import json, os, time
kids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = bytearray(300 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
print(json.dumps([os.waitpid(pid, 0)[1] for pid in kids]))
"""


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    if not cgroup.available():
        pytest.skip("no writable cgroup here (v2 with memory+pids, or v1 memory and pids): per-process limits only")
    try:
        # 60 s: six children touching 300 MiB each took over 20 s on a loaded 2-core machine (a timeout, not a cap).
        return PythonSandbox(SandboxLimits(timeout_s=60, memory_mb=400, max_processes=8, run_memory_mb=512))
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def _children(sandbox: PythonSandbox) -> list[int]:
    result = sandbox.run(SPREAD)
    assert result.ok, result
    return json.loads(result.stdout)


def _runs_left() -> list[str]:
    """This process's run cgroups (`run-<pid ns>-<pid>-<hex>`): another process's runs (an xdist worker's sandbox
    tests, a concurrent session) come and go while a test runs, and are theirs."""
    import os

    folders = [p for p in cgroup.parents().values() if p.is_dir()]
    mine = f"-{os.getpid()}-"
    return [p.name for parent in folders for p in parent.iterdir() if p.name.startswith("run-") and mine in p.name]


def test_memory_spread_over_processes_is_capped_for_the_whole_run(
    sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = set(_runs_left())
    statuses = _children(sandbox)
    # 512 MiB for the run: at most one 300 MiB child can hold its block; the kernel kills the others (SIGKILL).
    assert sum(s == 0 for s in statuses) <= 1 and sum(s == 9 for s in statuses) >= 5, statuses
    assert set(_runs_left()) <= before  # each run's cgroup is removed with it
    # The same program without the cgroup: per-process limits alone let every child hold its block.
    monkeypatch.setattr(runner.RunCgroup, "create", classmethod(lambda cls, *a: None))
    assert _children(sandbox) == [0] * 6


def test_runs_of_a_process_that_is_gone_are_swept_with_what_runs_in_them(sandbox: PythonSandbox) -> None:
    """A trainer killed mid-run leaves its run cgroups (and the processes in them); the next process's first run
    removes them. A live process's runs are left alone."""
    import subprocess
    import time

    gone = subprocess.Popen(["/bin/true"])
    gone.wait()
    dead = cgroup.RunCgroup.create(64 << 20, 4)
    live = cgroup.RunCgroup.create(64 << 20, 4)
    assert dead is not None and live is not None
    # Rename them as if another process of this PID namespace had made them: one whose pid is gone, one whose
    # pid (1) runs.
    ns = cgroup._pid_ns()
    dead_folders = tuple(f.rename(f.parent / f"run-{ns}-{gone.pid}-0123456789ab") for f in dead.folders)
    live_folders = tuple(f.rename(f.parent / f"run-{ns}-1-ba9876543210") for f in live.folders)
    orphan = subprocess.Popen(cgroup.RunCgroup(dead_folders).enter_argv(["sleep", "60"]))
    deadline = time.monotonic() + 60  # a process start: seconds on a loaded machine
    while not all(cgroup._pids(f) for f in dead_folders):
        assert time.monotonic() < deadline and orphan.poll() is None
        time.sleep(0.01)
    try:
        # At least these: a process killed elsewhere on this machine (another test's, a helper's) may have left
        # run cgroups of its own, which the sweep removes as well and counts.
        assert cgroup.sweep_stale.__wrapped__() >= len(dead_folders)
        assert orphan.wait(timeout=50) == -9  # killed with its cgroup (not killed: its 60 s end, status 0)
        assert not any(f.exists() for f in dead_folders) and all(f.exists() for f in live_folders)
    finally:
        cgroup.RunCgroup(live_folders).close()
        cgroup.RunCgroup(dead_folders).close()
        if orphan.poll() is None:
            orphan.kill()
    assert not any(f.exists() for f in live_folders)


def test_a_pid_this_namespace_cannot_see_is_never_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cgroup v2 lists a process of a PID namespace this one cannot see (another container's run, met by the
    sweep) as pid 0; `close` sent it SIGKILL, and kill(0, SIGKILL) is the caller's own process group: the
    trainer. Runs no sandbox: the cgroup folder is a stand-in."""
    import signal

    folder = tmp_path / "run-1-0123456789ab"
    folder.mkdir()
    (folder / "cgroup.procs").write_text("0\n424242\n0\n")
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(cgroup.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setattr(cgroup, "_remove", lambda folder: None)
    assert cgroup._pids(folder) == [424242]
    cgroup.RunCgroup((folder,)).close()
    assert kills and set(kills) == {(424242, signal.SIGKILL)}, kills
