"""A fresh interpreter a sandboxed program starts (a `spawn`/`forkserver` pool's worker, a subprocess) sees the
run's CPU count in `os.cpu_count()`, not the host's.

The launcher pins the run and patches `os.cpu_count` in the program's own interpreter (test_sandbox_cpus.py); a
new interpreter, started with -I (PYTHON_CPU_COUNT ignored) on Python < 3.13, asked glibc, which counted the host's
CPUs from /proc/stat: a nested pool in a spawn worker started the host's core count of processes. Under bubblewrap the
sandbox's /sys/devices/system/cpu/online says the run's count. Unsandboxed runs are not covered (runner.py says so).
Skips, with the reason, where bubblewrap cannot run (install roll-envs[code]) or roll may use one CPU only.
"""

from __future__ import annotations

import os

import pytest

from roll_envs.sandbox import OK, PythonSandbox, SandboxLimits, SandboxUnavailableError
from roll_envs.sandbox.runner import run_cpus

FRESH = """
import multiprocessing
import os
import subprocess
import sys


def counts(_):
    return os.cpu_count(), len(os.sched_getaffinity(0))


if __name__ == "__main__":
    probe = "import os; print(os.cpu_count(), len(os.sched_getaffinity(0)))"
    print(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip())
    for method in ("spawn", "forkserver"):
        with multiprocessing.get_context(method).Pool(1) as pool:
            print(*pool.map(counts, [0])[0])
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="roll may use one CPU here: nothing to narrow")
def test_fresh_interpreters_in_the_sandbox_see_the_runs_cpu_count() -> None:
    limits = SandboxLimits(timeout_s=60, cpus=1)
    try:
        sandbox = PythonSandbox(limits)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")
    res = sandbox.run(FRESH)
    assert res.status == OK, res.stderr[-2000:]
    # os.cpu_count() and the affinity agree: subprocess, spawn worker, forkserver worker (each said the host's count).
    assert res.stdout.splitlines() == ["1 1", "1 1", "1 1"], res.stdout


def test_the_runs_cpu_count_is_capped_by_the_cpus_roll_may_use() -> None:
    host = len(os.sched_getaffinity(0))
    assert run_cpus(SandboxLimits(cpus=1)) == 1
    assert run_cpus(SandboxLimits(max_processes=64, cpus=60)) == min(60, host)
