"""Sandbox run cgroups (roll_envs.sandbox.cgroup) met by processes of other PID namespaces: a container sharing the
cgroup parent, `docker exec`, a trainer under bwrap or a pid-namespaced launcher. A pid of another namespace means
nothing here, so the sweep must leave its runs alone; and `close` from a namespace that cannot see a run's processes
must still kill them where cgroup v2 `cgroup.kill` exists (and say why it cannot elsewhere).

Real cgroups, real namespaces (`unshare --pid`, as root): skips where no writable cgroup or no `unshare` exists."""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from roll_envs.sandbox import cgroup


@pytest.fixture
def runs() -> Iterator[list[tuple[Path, ...]]]:
    """Run cgroups a test makes (append their folders): closed afterwards, whatever happened."""
    made: list[tuple[Path, ...]] = []
    if cgroup._layout() is None:
        pytest.skip("no writable cgroup here (v2 with memory+pids, or v1 memory and pids)")
    yield made
    for folders in made:
        cgroup.RunCgroup(folders).close()


def _sleep_in(folders: tuple[Path, ...]) -> subprocess.Popen:
    """A `sleep 60` moved into the cgroup `folders`, once it is inside."""
    proc = subprocess.Popen(cgroup.RunCgroup(folders).enter_argv(["sleep", "60"]))
    deadline = time.monotonic() + 60  # a process start: seconds on a loaded machine
    while not all(proc.pid in cgroup._pids(f) for f in folders):
        assert time.monotonic() < deadline and proc.poll() is None, "the sleep never entered its cgroup"
        time.sleep(0.01)
    return proc


def _free_pid() -> int:
    """A pid no process has here (high, so that nothing started during the test takes it)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text()) - 2
    for pid in random.sample(range(max(top - 10_000, 1_000), top), 200):
        if not cgroup._alive(pid):
            return pid
    pytest.skip("no free pid found")


def _need_unshare() -> None:
    """Skip unless this process may make PID namespaces (`unshare --pid`: root, CAP_SYS_ADMIN)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.strip()}")


def _in_new_pid_namespace(code: str, *, pid: int | None = None, **popen: object) -> subprocess.Popen:
    """Python `code` in a new PID namespace (its own /proc), as pid `pid` of that namespace where given."""
    _need_unshare()
    # The namespace's next pid comes after ns_last_pid; the trailing `exit` keeps sh from exec'ing python as pid 1.
    script = (f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid || exit 99; " if pid else "") + '"$0" -c "$1"; exit $?'
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script, sys.executable, code]
    return subprocess.Popen(argv, text=True, **popen)


CREATOR = """
import json, os, sys
from roll_envs.sandbox import cgroup
run = cgroup.RunCgroup.create(64 << 20, 4)
print(json.dumps({"pid": os.getpid(), "folders": [str(f) for f in run.folders] if run else None}), flush=True)
sys.stdin.read()  # alive until the test closes stdin; the test closes the run (its sleep is invisible from here)
"""


def test_live_runs_of_a_creator_in_another_pid_namespace_are_not_swept(
    runs: list[tuple[Path, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer in its own PID namespace creates a run whose name carries its pid there, one that no process has
    in this namespace: this process's first sweep took that run for a leftover and killed what ran in it."""
    pid = _free_pid()
    creator = _in_new_pid_namespace(CREATOR, pid=pid, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    sleep = None
    try:
        line = creator.stdout.readline()
        if not line:
            pytest.skip(f"could not start a process in a new PID namespace (exit status {creator.wait(timeout=60)})")
        made = json.loads(line)
        assert made["pid"] == pid and made["folders"], made
        folders = tuple(map(Path, made["folders"]))
        runs.append(folders)
        sleep = _sleep_in(folders)
        assert not cgroup._alive(pid)  # the creator's pid means nothing here (it has another one)
        with caplog.at_level(logging.INFO, logger=cgroup.__name__):
            cgroup.sweep_stale.__wrapped__()
        assert sleep.poll() is None and all(f.exists() for f in folders)
        said = [r.getMessage() for r in caplog.records]
        assert any("other PID namespaces" in m and folders[0].name in m for m in said), said
    finally:
        creator.stdin.close()
        creator.wait(timeout=60)
        if sleep is not None and sleep.poll() is None:
            sleep.kill()
            sleep.wait()


def test_runs_of_an_older_version_lose_only_empty_leftovers(runs: list[tuple[Path, ...]]) -> None:
    """`run-<pid>-<hex>` (before names carried the PID namespace): its pid may be another namespace's, so what runs
    in it is not killed; an empty one whose pid is not alive here is a leftover and goes."""
    pid = _free_pid()
    busy, empty = cgroup.RunCgroup.create(64 << 20, 4), cgroup.RunCgroup.create(64 << 20, 4)
    assert busy is not None and empty is not None
    busy_folders = tuple(f.rename(f.parent / f"run-{pid}-0123456789ab") for f in busy.folders)
    empty_folders = tuple(f.rename(f.parent / f"run-{pid}-ba9876543210") for f in empty.folders)
    runs.extend([busy_folders, empty_folders])
    sleep = _sleep_in(busy_folders)
    try:
        assert cgroup.sweep_stale.__wrapped__() >= len(empty_folders)
        assert sleep.poll() is None and all(f.exists() for f in busy_folders)
        assert not any(f.exists() for f in empty_folders)
    finally:
        sleep.kill()
        sleep.wait()


CLOSER = """
import logging, sys
from pathlib import Path
from roll_envs.sandbox import cgroup
logging.basicConfig(level=logging.WARNING)
cgroup.RunCgroup(tuple(map(Path, sys.argv[1:]))).close()
"""


def _close_from_new_pid_namespace(folders: tuple[Path, ...]) -> str:
    """Close the run `folders` from a new PID namespace, which cannot see this namespace's processes; its log."""
    argv = ["unshare", "--pid", "--fork", sys.executable, "-c", CLOSER, *map(str, folders)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stderr


def _v2_folder() -> Path:
    """A fresh folder in this process's cgroup of the v2 hierarchy, wherever that is mounted (skips if none is
    writable or the kernel has no cgroup.kill)."""
    own = cgroup._own_path(None).lstrip("/")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            folder = Path(fields[0].split()[4]) / own / f"roll-test-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                folder.mkdir()
            except OSError:
                continue
            if (folder / "cgroup.kill").exists():
                return folder
            folder.rmdir()
    pytest.skip("no writable cgroup v2 folder with cgroup.kill (Linux >= 5.14) here")


def test_close_kills_processes_of_a_pid_namespace_it_cannot_see_through_cgroup_kill() -> None:
    """cgroup.procs lists such a process as 0, which the pid loop must skip: it survived, and the cgroup stayed."""
    _need_unshare()
    folder = _v2_folder()
    sleep = None
    try:
        sleep = _sleep_in((folder,))
        log = _close_from_new_pid_namespace((folder,))
        assert sleep.wait(timeout=50) == -signal.SIGKILL, log  # (not killed: its 60 s end, status 0)
        assert not folder.exists(), log
    finally:
        if sleep is not None and sleep.poll() is None:
            sleep.kill()
            sleep.wait()
        if folder.exists():
            cgroup._remove(folder)


def test_where_only_pids_can_be_killed_the_warning_names_invisible_processes(runs: list[tuple[Path, ...]]) -> None:
    """cgroup v1 (or v2 before Linux 5.14) has no cgroup.kill: a closer that cannot see a run's processes leaves
    them, and its warning says that this is why the cgroup stays."""
    _need_unshare()
    run = cgroup.RunCgroup.create(64 << 20, 4)
    assert run is not None
    runs.append(run.folders)
    if any((f / "cgroup.kill").exists() for f in run.folders):
        pytest.skip("runs here are cgroup v2 with cgroup.kill (the test above covers them)")
    sleep = _sleep_in(run.folders)
    try:
        log = _close_from_new_pid_namespace(run.folders)
        assert sleep.poll() is None and all(f.exists() for f in run.folders)
        assert "could not be removed" in log and "PID namespace this process cannot see" in log, log
        run.close()  # from here, where the sleep is visible: killed and removed
        assert sleep.wait(timeout=50) == -signal.SIGKILL and not any(f.exists() for f in run.folders)
    finally:
        if sleep.poll() is None:
            sleep.kill()
            sleep.wait()


@pytest.mark.parametrize("refused", [False, True], ids=["cgroup.kill", "cgroup.kill-refused"])
def test_close_uses_cgroup_kill_where_the_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """Where no v2 cgroup is writable (then the real test above skips): a tmp folder stands in for the cgroup.
    With cgroup.kill, "1" is written there and no pid is signalled one by one; a refused write falls back to
    the pid loop."""
    folder = tmp_path / "run-1-2-0123456789ab"
    folder.mkdir()
    (folder / "cgroup.procs").write_text("424242\n")
    if refused:
        (folder / "cgroup.kill").mkdir()  # writing it fails
    else:
        (folder / "cgroup.kill").write_text("")
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(cgroup.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setattr(cgroup, "_remove", lambda folder: None)
    cgroup.RunCgroup((folder,)).close()
    if refused:
        assert kills and set(kills) == {(424242, signal.SIGKILL)}, kills
    else:
        assert (folder / "cgroup.kill").read_text() == "1" and kills == []
