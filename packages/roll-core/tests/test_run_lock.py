"""The run-folder lock (roll_core.run_lock) against real second processes: a held folder is refused with the holder's
pid, host and start; a SIGKILLed holder (or its forked child) leaves no stale lock; one process shares its own lock
until the last handle goes; a filesystem without flock gives a warning, not a failure."""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from roll_core import run_lock
from roll_core.errors import ConfigError
from roll_core.run_lock import LOCK_NAME, hold_run_folder

#: A second process: takes the lock on argv[1] (exit 3 and the message when refused), says HELD, then holds it for
#: argv[2] seconds; with argv[3] == "fork" it first forks a child that sleeps (and prints the child's pid).
SCRIPT = """
import os, sys, time
from roll_core.errors import ConfigError
from roll_core.run_lock import hold_run_folder
try:
    lock = hold_run_folder(sys.argv[1])
except ConfigError as e:
    print("REFUSED", e, flush=True)
    sys.exit(3)
child = 0
if len(sys.argv) > 3:
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(w, b"x")  # the at-fork handlers ran (before fork() returned here)
        time.sleep(60)
        os._exit(0)
    os.read(r, 1)  # else a loaded machine let the driver die before its child had run them
print("HELD", os.getpid(), child, flush=True)
time.sleep(float(sys.argv[2]))
"""


def _probe(folder: Path) -> subprocess.CompletedProcess:
    """Another process trying the lock once (and giving it back at once)."""
    return subprocess.run([sys.executable, "-c", SCRIPT, str(folder), "0"], capture_output=True, text=True, timeout=60)


def _holder(folder: Path, fork: bool = False) -> tuple[subprocess.Popen, list[str]]:
    """Another process holding the lock until killed; returns it and its HELD line's fields."""
    args = [sys.executable, "-c", SCRIPT, str(folder), "600", *(["fork"] if fork else [])]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line and line[0] == "HELD", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()


def test_a_second_process_is_refused_naming_the_holder_and_other_folders_are_free(tmp_path: Path) -> None:
    lock = hold_run_folder(tmp_path / "run")
    try:
        assert lock.locked
        record = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname() and record["started"]
        refused = _probe(tmp_path / "run")
        assert refused.returncode == 3, refused.stderr
        msg = refused.stdout
        who = f"(pid {os.getpid()} on {socket.gethostname()}, started {record['started']}; lock "
        assert f"{tmp_path / 'run'} is in use by another roll process {who}" in msg
        assert f"kill {os.getpid()}" in msg and "another pipeline.output_dir" in msg and "Wait for it" in msg
        # a multirun's jobs: each its own folder, none refused
        assert _probe(tmp_path / "run" / "0").returncode == 0
        assert _probe(tmp_path / "other").returncode == 0
    finally:
        lock.release()
    assert _probe(tmp_path / "run").returncode == 0  # given back: the next process gets it
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""  # and the record names no holder any more


def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    proc, (_, pid, _) = _holder(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"in use by another roll process \(pid {pid} on "):
            hold_run_folder(tmp_path)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # nothing of Python runs after it
        _kill(proc)
    lock = hold_run_folder(tmp_path)  # at once: the kernel dropped the dead process's lock
    try:
        assert lock.locked and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_forked_child_does_not_keep_a_killed_drivers_lock(tmp_path: Path) -> None:
    """A child forked by the driver (a data loader, a helper) inherited the lock's descriptor: while it lived, a
    SIGKILLed driver's folder stayed locked."""
    proc, (_, _, child) = _holder(tmp_path, fork=True)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        _kill(proc)
        os.kill(int(child), 0)  # the child still lives
        hold_run_folder(tmp_path).release()
    finally:
        os.kill(int(child), signal.SIGKILL)


def test_one_process_shares_its_lock_until_the_last_handle_goes(tmp_path: Path) -> None:
    """A run restart builds a new pipeline on the folder this process holds: it must not refuse itself."""
    first = hold_run_folder(tmp_path / "run")
    second = hold_run_folder(tmp_path / "x" / ".." / "run")  # the same folder, spelled otherwise
    kept = first.share()
    first.release()
    first.release()  # idempotent: one handle counts once
    second.release()
    assert _probe(tmp_path / "run").returncode == 3  # `kept` still holds it
    kept.release()
    assert _probe(tmp_path / "run").returncode == 0
    with pytest.raises(RuntimeError, match="already released"):
        kept.share()
    # a handle dropped without release() (a pipeline run without shutdown()) gives the lock back when collected
    dropped = hold_run_folder(tmp_path / "run")
    assert _probe(tmp_path / "run").returncode == 3
    del dropped
    gc.collect()
    assert _probe(tmp_path / "run").returncode == 0


def test_a_filesystem_without_flock_gives_a_warning_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with caplog.at_level(logging.WARNING, logger=run_lock.__name__):
        lock = hold_run_folder(tmp_path)
    assert not lock.locked
    assert any("does not support flock" in r.getMessage() and "not locked" in r.getMessage() for r in caplog.records)
    lock.release()
    assert not run_lock._held  # nothing left open

    def broken(fd: int, op: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fcntl, "flock", broken)  # any other error is not "unsupported": it is raised
    with pytest.raises(OSError, match="Input/output error"):
        hold_run_folder(tmp_path)
    assert not run_lock._held
