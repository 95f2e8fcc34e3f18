"""The sandbox runner itself: run statuses, what the bwrap command line exposes, limits, concurrency.

Containment against hostile programs is the escape suite's job (test_sandbox_escapes.py). Tests that run
programs skip, with the reason, where bubblewrap cannot run (install roll-envs[code]).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from roll_envs.sandbox import (
    CHILD_MARKER,
    OK,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
    SANDBOX_ERROR,
    TIMEOUT,
    PythonSandbox,
    SandboxLimits,
    SandboxUnavailableError,
    make_sandbox,
    runner,
)
from roll_envs.sandbox import bwrap as bwrap_module


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    try:
        # A generous wall clock: on a loaded 2-core machine bwrap and Python's start alone took over 1.5 s (the test
        # of the timeout sets its own).
        return PythonSandbox(SandboxLimits(timeout_s=30, max_output_bytes=10_000))
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def test_statuses(sandbox: PythonSandbox) -> None:
    ok = sandbox.run("import sys\nprint(sys.stdin.read().upper(), end='')\n", "héllo\n")
    assert ok.status == OK and ok.stdout == "HÉLLO\n" and ok.returncode == 0 and ok.ok
    crash = sandbox.run("print('partial')\nraise KeyError('boom')\n")
    assert crash.status == RUNTIME_ERROR and crash.stdout == "partial\n" and "KeyError: 'boom'" in crash.stderr
    assert sandbox.run("exit(4)").status == RUNTIME_ERROR and sandbox.run("quit()").status == OK
    assert sandbox.run("this is not python").status == RUNTIME_ERROR
    from dataclasses import replace

    limits = sandbox.limits
    try:
        sandbox.limits = replace(limits, timeout_s=4)
        start = time.monotonic()
        sleeper = sandbox.run("import os, time\nos.close(1)\ntime.sleep(60)\n")  # closes stdout, keeps running
        elapsed = time.monotonic() - start
    finally:
        sandbox.limits = limits
    # Killed at its 4 s deadline, not at the end of its 60 s sleep (slack for a loaded machine).
    assert sleeper.status == TIMEOUT and sleeper.returncode is None and elapsed < 30, (sleeper, elapsed)
    flood = sandbox.run("print('y' * 20_000)")
    assert flood.status == OUTPUT_LIMIT and len(flood.stdout) <= 10_000


def test_a_deadline_before_the_sandbox_is_up_is_a_sandbox_error(sandbox: PythonSandbox) -> None:
    """A start budget shorter than the sandbox's start (a loaded machine): the program never ran, so the run is the
    sandbox's failure (`sandbox_error`), not the program's timeout (a correct program would have scored 0)."""
    from dataclasses import replace

    limits = sandbox.limits
    try:
        sandbox.limits = replace(limits, start_timeout_s=0.002)
        assert sandbox.run("print(input())", "hi\n").status == SANDBOX_ERROR
    finally:
        sandbox.limits = limits
    assert sandbox.run("print(input())", "hi\n").stdout == "hi\n"


def test_a_slow_start_does_not_eat_the_programs_time(sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """The program's wall clock starts when the sandbox is up: a start slowed to 1.5 s (a loaded machine) left a
    2 s program 0.5 s, and a right answer taking 1 s was scored a timeout (a wrong answer) instead of passing."""
    from dataclasses import replace

    slow = runner.CHILD_SOURCE.replace(
        "def main() -> None:\n", "def main() -> None:\n    __import__('time').sleep(1.5)\n"
    )
    assert slow != runner.CHILD_SOURCE
    monkeypatch.setattr(runner, "CHILD_SOURCE", slow)
    # A start budget of 60 s: the spinning program below would run until then were its own 2 s clock not held.
    monkeypatch.setattr(sandbox, "limits", replace(sandbox.limits, timeout_s=2.0, start_timeout_s=60.0))
    right = sandbox.run("import time\ntime.sleep(1.0)\nprint(input())\n", "42\n")
    assert right.status == OK and right.stdout == "42\n" and right.seconds > 2.0, right
    # The program's own clock still holds: 2 s after the start, not the start budget.
    start = time.monotonic()
    spins = sandbox.run("while True:\n    pass\n")
    assert spins.status == TIMEOUT and time.monotonic() - start < 30, spins  # (slack for a loaded machine)


def test_a_slow_check_is_not_a_missing_sandbox(sandbox: PythonSandbox, caplog: pytest.LogCaptureFixture) -> None:
    """The constructor's probe ran under the runs' own clock: a start slower than it (a loaded machine, a tight
    timeout) made a working bwrap look missing, so the reward refused to start or, with the unsandboxed fallback
    allowed, ran every program of the run without isolation. Now the probe has roomy clocks of its own, the
    sandbox is bwrap, and a run that cannot start in its budget is a sandbox_error."""
    import logging

    tight = SandboxLimits(timeout_s=0.001, start_timeout_s=0.001)
    with caplog.at_level(logging.WARNING):
        made = make_sandbox(tight, allow_unsandboxed=True)
    assert made.mode == "bwrap" and "UNSANDBOXED" not in caplog.text, caplog.text
    assert made.run("print(input())", "hi\n").status == SANDBOX_ERROR


def test_bwrap_gets_none_of_the_trainers_environment(sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """bwrap ran with the trainer's whole environment (WANDB_API_KEY, HF_TOKEN...): as root its init is the
    sandbox's PID 1, the program's parent, holding the secrets in /proc/1/environ behind nothing but the uid drop.
    Now no process of a run (bwrap's and the program's) carries any of it."""
    import threading

    token = "roll-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("WANDB_API_KEY", token)
    monkeypatch.setenv("HF_TOKEN", token)
    result: list[object] = []
    run = threading.Thread(target=lambda: result.append(sandbox.run("import time\ntime.sleep(4)\nprint('done')\n")))
    run.start()
    seen: dict[int, bytes] = {}

    def program(cmd: bytes) -> bool:  # the sandboxed interpreter: not bwrap, nor the /bin/sh that joins the cgroup
        return b"bwrap" not in cmd and not cmd.endswith(b"/sh")  # (caught before its exec under load: CI flake)

    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline and not any(program(cmd) for cmd in seen.values()):
            for pid in _run_processes():
                try:
                    seen[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                except OSError:
                    continue
            time.sleep(0.05)
        environ = {pid: Path(f"/proc/{pid}/environ").read_bytes() for pid in seen}
    finally:
        run.join()
    assert any(b"bwrap" in cmd for cmd in seen.values()) and any(program(cmd) for cmd in seen.values()), seen
    leaked = [seen[pid] for pid, env in environ.items() if token.encode() in env]
    assert not leaked, f"the trainer's secrets are in the environment of {leaked}"
    assert getattr(result[0], "stdout", None) == "done\n", result


def _run_processes() -> list[int]:
    """Pids of this process's descendants that belong to a sandbox run (their command line has CHILD_MARKER)."""
    me, found = os.getpid(), []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if CHILD_MARKER.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            ancestor = pid
            while ancestor > 1 and ancestor != me:
                ancestor = int(Path(f"/proc/{ancestor}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ancestor == me:
            found.append(pid)
    return found


def test_a_broken_sandbox_is_a_sandbox_error_not_a_wrong_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bwrap_module.bwrap_argv
    monkeypatch.setattr(bwrap_module, "bwrap_argv", lambda *a, **k: [*real(*a, **k), "--no-such-option"])
    # Status sandbox_error, not timeout: the failure is known when bwrap exits (at once), not at the 20 s timeout.
    with pytest.raises(SandboxUnavailableError, match=r"status sandbox_error.*pip install 'roll-envs\[code\]'"):
        try:
            PythonSandbox(SandboxLimits(timeout_s=20))
        except SandboxUnavailableError as exc:
            if "needs bubblewrap" in str(exc):
                pytest.skip(f"no bubblewrap here: {exc}")
            raise


def test_command_line_exposes_only_the_interpreter_and_system_libraries(tmp_path: Path) -> None:
    interp = bwrap_module.interpreter(None)
    argv = bwrap_module.bwrap_argv(
        "bwrap", interp, as_root=False, tmp_bytes=1 << 20, shm_bytes=1 << 20, code_fd=9, status_fd=10
    )
    for flag in ("--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv", "--as-pid-1"):
        assert flag in argv
    assert "--share-net" not in argv and "--bind" not in argv  # nothing writable
    # Devices: only the plain ones, no devpts (bwrap's --dev mounts one).
    assert "--dev" not in argv
    dev_binds = [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == "--dev-bind"]
    assert dev_binds == [(f"/dev/{name}", f"/dev/{name}") for name in ("null", "zero", "full", "random", "urandom")]
    sources = [argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--ro-bind-try")]
    allowed = {*bwrap_module.SYSTEM_PATHS, "/etc/ld.so.cache", *interp.folders}
    assert set(sources) <= allowed, set(sources) - allowed
    others = [s for s in sources if s not in interp.folders and s != "/etc/ld.so.cache"]
    for hidden in ("/home", "/work", "/tmp", "/root", "/etc", os.getcwd(), str(tmp_path)):
        assert not any(hidden == s or s.startswith(hidden.rstrip("/") + "/") for s in others), hidden
    assert argv.index("--remount-ro") > max(i for i, a in enumerate(argv) if a in ("--ro-bind", "--tmpfs"))
    root = bwrap_module.bwrap_argv(
        "bwrap", interp, as_root=True, tmp_bytes=1 << 20, shm_bytes=1 << 20, code_fd=9, status_fd=10
    )
    assert "--unshare-user" not in root and "--unshare-net" in root and "--unshare-pid" in root
    assert root[root.index("--cap-drop") + 1] == "ALL"
    assert [root[i + 1] for i, a in enumerate(root) if a == "--cap-add"] == ["CAP_SETUID", "CAP_SETGID"]


def test_dev_has_the_plain_devices_and_no_pseudo_terminals(sandbox: PythonSandbox) -> None:
    """bwrap's `--dev` mounted a devpts: every pseudo-terminal a program opened there counted against the host-wide
    kernel.pty.max shared with every container's terminals, up to max_processes x max_open_files of them per run."""
    program = """import errno, os
print(sorted(os.listdir("/dev")))
for opener in (os.openpty, lambda: os.open("/dev/ptmx", os.O_RDWR), lambda: os.open("/dev/tty", os.O_RDWR)):
    try:
        opener()
        print("opened")
    except OSError as exc:
        print(errno.errorcode[exc.errno])
print(len(open("/dev/urandom", "rb").read(8)), open("/dev/zero", "rb").read(2), open("/dev/stdin").read())
os.write(os.open("/dev/null", os.O_WRONLY), b"x")
for path, flags in (("/dev/full", os.O_WRONLY), ("/dev/new", os.O_WRONLY | os.O_CREAT)):
    try:
        os.write(os.open(path, flags), b"x")
    except OSError as exc:
        print(errno.errorcode[exc.errno])
"""
    res = sandbox.run(program, "in")
    assert res.status == OK, res.stderr
    devices = ["fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout", "urandom", "zero"]
    no_ptys = ["ENOENT"] * 3  # openpty, /dev/ptmx, /dev/tty
    assert res.stdout.splitlines() == [str(devices), *no_ptys, "8 b'\\x00\\x00' in", "ENOSPC", "EROFS"]


def test_a_sandbox_without_a_run_cgroup_says_run_memory_mb_is_not_enforced(
    sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where no cgroup could be made, runs went without run_memory_mb (and without a bound on the kernel memory of
    the files a program creates in /tmp) with nothing above INFO in the log."""
    from roll_envs.sandbox import cgroup

    monkeypatch.setattr(cgroup, "_layout", lambda: None)
    cgroup.available.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=cgroup.__name__):
            PythonSandbox(sandbox.limits)
    finally:
        cgroup.available.cache_clear()  # the next caller asks the real layout again
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == cgroup.__name__]
    assert len(warned) == 1 and "run_memory_mb is NOT enforced" in warned[0] and "/tmp" in warned[0], warned


def test_interpreter_outside_its_own_prefix_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    with pytest.raises(ValueError, match="cannot expose"):
        bwrap_module.interpreter(str(fake))  # lives in the host's /tmp, which the sandbox must hide


def test_limits_validate_and_map_to_rlimits() -> None:
    limits = SandboxLimits(timeout_s=2.5, memory_mb=128, max_processes=3, max_open_files=32, max_file_mb=2)
    r = limits.rlimits()
    assert r["RLIMIT_CPU"] == (3, 4) and r["RLIMIT_AS"] == (128 << 20, 128 << 20) and r["RLIMIT_NPROC"] == (3, 3)
    assert r["RLIMIT_NOFILE"] == (32, 32) and r["RLIMIT_FSIZE"] == (2 << 20, 2 << 20) and r["RLIMIT_CORE"] == (0, 0)
    for bad in (
        {"timeout_s": 0},
        {"start_timeout_s": 0},
        {"memory_mb": 16},
        {"max_processes": 0},
        {"max_open_files": 4},
    ):
        with pytest.raises(ValueError):
            SandboxLimits(**bad)  # type: ignore[arg-type]


def test_process_and_memory_limits_hold(sandbox: PythonSandbox) -> None:
    forks = sandbox.run(
        "import os, time\nn = 0\ntry:\n    for _ in range(50):\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)\n"
    )
    assert forks.status == OK and int(forks.stdout) == sandbox.limits.max_processes - 1
    big = sandbox.run("x = bytearray(600 * 1024 * 1024)")  # above memory_mb=512
    assert big.status == RUNTIME_ERROR and "MemoryError" in big.stderr


def test_concurrent_runs_do_not_mix(sandbox: PythonSandbox) -> None:
    def one(i: int) -> str:
        return sandbox.run("import sys\nprint(int(sys.stdin.read()) * 2)\n", f"{i}\n").stdout

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(24))) == [f"{2 * i}\n" for i in range(24)]


def test_a_capped_sandbox_pickles_and_keeps_its_cap() -> None:
    """A sandbox with a run cap (max_concurrent_runs) goes to another process as any reward may (its semaphore is
    made anew there), and the copy still runs programs, at most that many at once."""
    import pickle

    capped = PythonSandbox(max_concurrent_runs=2)
    copy = pickle.loads(pickle.dumps(capped))
    assert copy.max_concurrent_runs == 2 and copy._slots is not None and copy._slots is not capped._slots
    assert copy.run("print(6 * 7)").stdout.strip() == "42"
