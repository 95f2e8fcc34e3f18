"""The CPUs a sandboxed program sees: pinned to `SandboxLimits.cpus`, and `os.cpu_count()` agrees inside.

`multiprocessing.Pool()`, `ProcessPoolExecutor()` and joblib start `os.cpu_count()` workers; on a host with more
cores than `max_processes` allows, the pool's fork or thread start was refused and a correct program ended as
runtime_error. The tests simulate such a host by setting max_processes below what a pool of this host's core count
needs (a Pool of n workers needs n + 4 tasks: the main thread and three handler threads). Skips, with the reason,
where bubblewrap cannot run (install roll-envs[code]).
"""

from __future__ import annotations

import ast
import os

import pytest

from roll_envs.sandbox import OK, PythonSandbox, SandboxLimits, SandboxUnavailableError

HOST_CPUS = len(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(HOST_CPUS < 2, reason="roll may use one CPU here: nothing to narrow")

COUNTS = """
import ast
import os
print(os.cpu_count(), len(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(0)))
print(*(os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")))
"""

POOL = """
import concurrent.futures
import multiprocessing


def square(x):
    return x * x


if __name__ == "__main__":
    with multiprocessing.Pool() as pool:
        print(pool.map(square, range(8)))
    with concurrent.futures.ProcessPoolExecutor() as ex:
        print(sum(ex.map(square, range(10))))
"""


def _sandbox(limits: SandboxLimits, unsandboxed: bool = False) -> PythonSandbox:
    try:
        return PythonSandbox(limits, unsandboxed=unsandboxed)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


@needs_two_cpus
@pytest.mark.parametrize("unsandboxed", [False, True], ids=["bwrap", "unsandboxed"])
@pytest.mark.parametrize("limit", [{"cpus": 1}, {"max_processes": 5}], ids=["cpus=1", "default-for-max_processes=5"])
def test_program_sees_and_runs_on_its_cpu_count(unsandboxed: bool, limit: dict[str, int]) -> None:
    sandbox = _sandbox(SandboxLimits(timeout_s=30, **limit), unsandboxed=unsandboxed)
    seen = set()
    for _ in range(HOST_CPUS):
        res = sandbox.run(COUNTS)
        assert res.status == OK, res.stderr[-2000:]
        counts, threads = res.stdout.splitlines()
        count, pinned, cpus = counts.split(" ", 2)
        assert (count, pinned, threads) == ("1", "1", "1 1 1"), res.stdout
        seen.update(ast.literal_eval(cpus))
    # Runs take turns over the CPUs roll may use: consecutive runs are not piled on one CPU.
    assert seen == os.sched_getaffinity(0)


@needs_two_cpus
def test_unsized_pools_fit_in_max_processes_on_a_host_with_more_cores() -> None:
    """max_processes leaves room for a one-worker pool only: the host's 2+ cores stand for a host with more cores
    than max_processes (a Pool of os.cpu_count() workers could not start its threads: runtime_error)."""
    limits = SandboxLimits(timeout_s=30, max_processes=5)  # main thread + 3 pool threads + 1 worker
    res = _sandbox(limits).run(POOL)
    assert res.status == OK, res.stderr[-2000:]
    assert res.stdout == "[0, 1, 4, 9, 16, 25, 36, 49]\n285\n"
    assert limits.program_cpus == 1  # the default follows max_processes


def test_default_cpus_follow_max_processes() -> None:
    assert SandboxLimits().program_cpus == 4
    assert SandboxLimits(max_processes=6).program_cpus == 2
    assert SandboxLimits(max_processes=1).program_cpus == 1
    assert SandboxLimits(max_processes=64).program_cpus == 4
    assert SandboxLimits(max_processes=64, cpus=60).program_cpus == 60


@pytest.mark.parametrize(
    ("cpus", "max_processes"), [(0, 8), (-1, 8), (5, 8), (2, 5), (2, 1), (1.5, 8), (True, 8), ("2", 8)]
)
def test_invalid_cpus_are_refused(cpus: object, max_processes: int) -> None:
    with pytest.raises(ValueError, match=r"cpus=.* must be an integer between 1 and"):
        SandboxLimits(cpus=cpus, max_processes=max_processes)  # type: ignore[arg-type]
