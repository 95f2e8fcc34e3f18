"""A cgroup per sandboxed run (roll_envs.sandbox.cgroup): memory split over many processes, each under its own
rlimit, is still capped for the run as a whole; the cgroup is gone after the run. Skips where no writable cgroup
exists (the runner then keeps per-process limits only and says so in the log)."""

from __future__ import annotations

import json

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
        return PythonSandbox(SandboxLimits(timeout_s=20, memory_mb=400, max_processes=8, run_memory_mb=512))
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def _children(sandbox: PythonSandbox) -> list[int]:
    result = sandbox.run(SPREAD)
    assert result.ok, result
    return json.loads(result.stdout)


def _runs_left() -> list[str]:
    folders = [p for p in cgroup.parents().values() if p.is_dir()]
    return [p.name for parent in folders for p in parent.iterdir() if p.name.startswith("run-")]


def test_memory_spread_over_processes_is_capped_for_the_whole_run(
    sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    statuses = _children(sandbox)
    # 512 MiB for the run: at most one 300 MiB child can hold its block; the kernel kills the others (SIGKILL).
    assert sum(s == 0 for s in statuses) <= 1 and sum(s == 9 for s in statuses) >= 5, statuses
    assert _runs_left() == []  # each run's cgroup is removed with it
    # The same program without the cgroup: per-process limits alone let every child hold its block.
    monkeypatch.setattr(runner.RunCgroup, "create", classmethod(lambda cls, *a: None))
    assert _children(sandbox) == [0] * 6
