"""The root conftest's watchdog: a test stuck where pytest-timeout's SIGALRM cannot reach it (here: SIGALRM blocked,
as in a native wait that retries on EINTR) ends its pytest process with every thread's stack printed, instead of
hanging the run (CI of 2026-12-07 hung at 98 % until its 90-minute limit)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUCK = """
import signal, time

def test_stuck_beyond_sigalrm():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # pytest-timeout's signal never arrives
    time.sleep(300)

def test_after():
    pass
"""


def _run(tmp_path: Path, grace: str) -> tuple[subprocess.CompletedProcess[str], float]:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_stuck.py").write_text(STUCK)
    env = {**os.environ, "ROLL_TEST_WATCHDOG_GRACE_S": grace}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--timeout", "1"]
    cmd += ["--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_stuck.py")]
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    return out, time.monotonic() - t0


def test_a_test_pytest_timeout_cannot_interrupt_ends_its_process_with_the_stacks(tmp_path: Path) -> None:
    out, took = _run(tmp_path, "2")
    assert out.returncode == 1, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    # 1 s limit + 2 s grace + pytest's start (tens of seconds on a loaded machine), not the 300 s sleep
    assert took < 150, took
    assert "Timeout (0:00:03)!" in out.stderr, out.stderr[-2000:]
    assert "test_stuck_beyond_sigalrm" in out.stderr  # the stuck test's frame is in the dump
