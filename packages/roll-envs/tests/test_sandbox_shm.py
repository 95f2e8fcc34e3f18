"""The sandbox's /dev/shm: `multiprocessing` works inside, and the folder is private to a run and size-capped.

Python's `multiprocessing` keeps its locks (POSIX named semaphores) in /dev/shm, so `Pool`, `Queue` and
`ProcessPoolExecutor` fail without a writable one; competitive-programming and data-science answers use them.
Skips, with the reason, where bubblewrap cannot run (install roll-envs[code]).
"""

from __future__ import annotations

import os
import secrets

import pytest

from roll_envs.sandbox import OK, PythonSandbox, SandboxLimits, SandboxUnavailableError
from roll_envs.sandbox import bwrap as bwrap_module
from roll_envs.sandbox.cgroup import available as cgroup_available

SHM_MB = 4


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    try:
        # Generous clocks for a loaded 2-core machine; a small /dev/shm (below the 16 MiB file-size limit, so a write
        # past it meets the folder's size, not RLIMIT_FSIZE).
        return PythonSandbox(SandboxLimits(timeout_s=30, shm_mb=SHM_MB, max_file_mb=16))
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def test_multiprocessing_pools_queues_and_executors_run(sandbox: PythonSandbox) -> None:
    program = """
import concurrent.futures
import multiprocessing


def square(x):
    return x * x


if __name__ == "__main__":
    with multiprocessing.Pool(2) as pool:
        print(pool.map(square, range(6)))
    with concurrent.futures.ProcessPoolExecutor(2) as ex:
        print(sum(ex.map(square, range(10))))
    q = multiprocessing.Queue()
    p = multiprocessing.Process(target=q.put, args=(42,))
    p.start()
    print(q.get())
    p.join()
"""
    res = sandbox.run(program)
    assert res.status == OK, res.stderr[-2000:]
    assert res.stdout == "[0, 1, 4, 9, 16, 25]\n285\n42\n"


def test_dev_shm_is_private_to_each_run(sandbox: PythonSandbox) -> None:
    name = f"roll-shm-{secrets.token_hex(8)}"
    write = f"""
import os
with open("/dev/shm/{name}", "w") as f:
    f.write("first run")
print(sorted(os.listdir("/dev/shm")))
"""
    first = sandbox.run(write)
    assert first.status == OK and first.stdout == f"['{name}']\n", first.stderr[-2000:]
    # Neither the next run nor the host sees the file.
    second = sandbox.run("import os\nprint(sorted(os.listdir('/dev/shm')))\n")
    assert second.status == OK and second.stdout == "[]\n", second.stderr[-2000:]
    assert not os.path.exists(f"/dev/shm/{name}")


def test_dev_shm_is_size_capped_inside_the_program(sandbox: PythonSandbox) -> None:
    program = """
import errno
written = 0
try:
    with open("/dev/shm/big", "wb") as f:
        for _ in range(12):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1
    print("wrote", written, "MiB")
except OSError as e:
    print("full after", written, "MiB:", errno.errorcode[e.errno])
"""
    res = sandbox.run(program)
    # The program itself sees the folder full at its size (a little less: the tmpfs rounds to pages).
    assert res.status == OK, res.stderr[-2000:]
    assert res.stdout in {f"full after {n} MiB: ENOSPC\n" for n in (SHM_MB - 1, SHM_MB)}, res.stdout


def test_dev_shm_counts_against_the_runs_memory(sandbox: PythonSandbox) -> None:
    """Where a run cgroup exists, /dev/shm pages are the run's memory: a folder larger than run_memory_mb cannot be
    filled (the run is killed or the write refused), so its size never adds to what a run may hold."""
    if not cgroup_available():
        pytest.skip("no writable cgroup here: run_memory_mb is not enforced")
    roomy = PythonSandbox(SandboxLimits(timeout_s=30, shm_mb=512, run_memory_mb=96))
    program = """
for i in range(32):
    with open(f"/dev/shm/f{i}", "wb") as f:
        f.write(b"x" * (8 << 20))
    print((i + 1) * 8, flush=True)
"""
    res = roomy.run(program)
    written = [int(line) for line in res.stdout.split()]
    # It did write to /dev/shm, and was stopped (killed, or its write refused) before 256 MiB.
    assert written[:1] == [8] and written[-1] < 256 and res.status != OK, res


def test_command_line_mounts_a_sized_dev_shm_before_dev_turns_read_only() -> None:
    interp = bwrap_module.interpreter()
    for as_root, perms in ((False, "0700"), (True, "1777")):
        argv = bwrap_module.bwrap_argv(
            "bwrap", interp, as_root=as_root, tmp_bytes=1 << 20, shm_bytes=3 << 20, code_fd=9, status_fd=10
        )
        at = argv.index("/dev/shm")
        assert argv[at - 5 : at + 1] == ["--perms", perms, "--size", str(3 << 20), "--tmpfs", "/dev/shm"]
        assert at < argv.index("--remount-ro")


def test_limits_refuse_an_empty_dev_shm() -> None:
    with pytest.raises(ValueError, match="shm_mb"):
        SandboxLimits(shm_mb=0)
