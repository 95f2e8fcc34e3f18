"""Running one untrusted child process to completion under a wall clock and an output budget.

Contract: `run_captured` starts the command in a new session (its own process group), feeds it stdin from a file
descriptor (never a pipe it could block on), reads stdout and stderr concurrently, and kills the run with SIGKILL
when a wall clock passes or when stdout + stderr exceed `max_output_bytes`. Two clocks: the sandbox's start (spawn
to the ready byte) has `start_timeout_s`, the program (ready byte to exit) has `timeout_s` of its own, so a slow
start on a loaded machine never eats the program's time and turns a right answer into a timeout; it never waits
longer than the two together plus the time the kernel takes to reap. Killing a run kills the init of its PID
namespace (known from bwrap's `--json-status-fd`, held as a pidfd checked to be in that namespace, so a recycled pid
is never hit), which takes every process of the namespace with it whatever the program did to itself (a cleared
parent-death signal, a new session), then the command's process group; an error while the run is watched (a
KeyboardInterrupt) kills it the same way before it reaches the caller. The child signals through `ready_fd` that its
setup finished; a child that exits without signalling, or reaches the wall clock or the output budget before
signalling (a start slower than `start_timeout_s`), is a `sandbox_error` (the sandbox, not the program, failed), and
so is a command that cannot be started at all (an OSError from fork/exec: EAGAIN, a missing bwrap), returned, not
raised. Exit status 0 is `ok`, any other exit or a signal is `runtime_error`, CPU-time exhaustion (SIGXCPU) is
`timeout`. The caller compares stdout with what it expects: no verdict is ever read from the child.

SIGXCPU versus exit status 152: a direct child killed by SIGXCPU has returncode -SIGXCPU, told apart from a program's
own `sys.exit(152)`. bwrap reports a signal death as the exit status 128 + n (its init and its monitor both do, and
nothing else of the sandbox outlives the run to say which it was), so under bwrap (`status_fd` given) a 152 is taken
for SIGXCPU only when the run lasted long enough for a process to have used up its CPU seconds
(`cpu_limit_after_s`); a sooner 152 is the program's exit status, a `runtime_error`. Not covered: a program that runs
past that point and then exits with 152 itself counts as a timeout.

The run ends when the command itself exits (watched through a pidfd): what its pipes hold by then is read, and
a descendant still holding them open (a detached grandchild of an unsandboxed program) is not waited for, so a
program that printed its answer and exited is judged by its exit status, not taken for a timeout. The command's
process group is killed at the end of every run, before the command is reaped (its id cannot be reused by then).

Covers: processes that hang, spin, flood their pipes, close their pipes and keep running, or exit early.
Does not cover: without bwrap (unsandboxed mode, no PID namespace), descendants that leave the process group
(`setsid`) can outlive the run unless the caller's run cgroup (runner.py) kills them. Without pidfds (Linux < 5.3)
the run waits for the pipes as before: a detached descendant holding them makes the run a timeout.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

OK = "ok"
RUNTIME_ERROR = "runtime_error"
TIMEOUT = "timeout"
OUTPUT_LIMIT = "output_limit"
SANDBOX_ERROR = "sandbox_error"
STATUSES = (OK, RUNTIME_ERROR, TIMEOUT, OUTPUT_LIMIT, SANDBOX_ERROR)

# Bytes of stderr kept for messages (all of it counts towards the output budget).
STDERR_KEPT = 8192
# Tasks a `multiprocessing.Pool` needs besides its workers: the main thread and the pool's three handler threads
# (measured: Pool(n) needs max_processes >= n + 4; ProcessPoolExecutor(n), n + 3).
POOL_OVERHEAD = 4
# CPUs a run sees when `SandboxLimits.cpus` is not set (fewer where max_processes leaves no room for them).
DEFAULT_CPUS = 4


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. Memory and file limits are per process; where a writable cgroup exists (see
    roll_envs.sandbox.cgroup) all processes of a run together are also held to `run_memory_mb` and
    `max_processes` (without one, a run may hold up to `max_processes * memory_mb`, plus `tmp_mb` and `shm_mb` of
    files)."""

    # Wall-clock seconds of the program, from the moment the sandbox is up (CPU seconds are capped at the same
    # value, rounded up).
    timeout_s: float = 5.0
    # Wall-clock seconds the sandbox may take to come up before the program starts; past it the run is a
    # sandbox_error (the program never ran), not a timeout.
    start_timeout_s: float = 10.0
    # Address space per process, MiB (RLIMIT_AS).
    memory_mb: int = 512
    # Processes and threads of the program (RLIMIT_NPROC); 1 forbids fork and threads.
    max_processes: int = 8
    # Open file descriptors per process (RLIMIT_NOFILE).
    max_open_files: int = 64
    # Largest file a process may write, MiB (RLIMIT_FSIZE).
    max_file_mb: int = 16
    # Size of the writable /tmp, MiB.
    tmp_mb: int = 64
    # Size of the writable /dev/shm (POSIX semaphores and shared memory: multiprocessing's locks, queues, pools),
    # MiB. Its pages, like /tmp's, count towards run_memory_mb where a run cgroup exists.
    shm_mb: int = 64
    # stdout + stderr bytes read before the run is killed.
    max_output_bytes: int = 1 << 20
    # Memory of all the run's processes together, MiB (a cgroup, where one is writable).
    run_memory_mb: int = 1024
    # CPUs the program is pinned to and that os.cpu_count() reports inside (fewer if roll may use fewer): the
    # worker count of `multiprocessing.Pool()` and the like. At most max(1, max_processes - POOL_OVERHEAD), so such
    # a pool fits in max_processes; None: min(DEFAULT_CPUS, that bound).
    cpus: int | None = None

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError(
                f"timeout_s and start_timeout_s must be > 0 seconds, got {self.timeout_s}, {self.start_timeout_s}"
            )
        sizes = (self.memory_mb, self.max_processes, self.max_open_files, self.max_file_mb, self.tmp_mb, self.shm_mb)
        if min(sizes) < 1:
            raise ValueError("memory_mb, max_processes, max_open_files, max_file_mb, tmp_mb and shm_mb must be >= 1")
        if self.run_memory_mb < 64:
            raise ValueError(f"run_memory_mb={self.run_memory_mb} is too small for a Python interpreter: use >= 64")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb={self.memory_mb} is too small for a Python interpreter: use >= 64")
        if self.max_open_files < 16:
            raise ValueError(f"max_open_files={self.max_open_files} is too small for Python: use >= 16")
        if self.max_output_bytes < 1:
            raise ValueError("max_output_bytes must be >= 1")
        if self.cpus is not None and (type(self.cpus) is not int or not 1 <= self.cpus <= self._max_cpus()):
            raise ValueError(
                f"cpus={self.cpus!r} must be an integer between 1 and max(1, max_processes - {POOL_OVERHEAD})"
                f" = {self._max_cpus()} (max_processes={self.max_processes}): a multiprocessing.Pool() of cpus"
                f" workers, its three threads and the main thread must fit in max_processes"
            )

    def _max_cpus(self) -> int:
        return max(1, self.max_processes - POOL_OVERHEAD)

    @property
    def program_cpus(self) -> int:
        """CPUs a run is given: `cpus`, or its default for `max_processes` (capped at run time by the CPUs roll may
        use)."""
        return self.cpus if self.cpus is not None else min(DEFAULT_CPUS, self._max_cpus())

    @property
    def cpu_limit_after_s(self) -> float:
        """Wall seconds from a run's spawn before which no process of it can have used up its CPU seconds (the soft
        RLIMIT_CPU): a process runs at most `max_processes` threads (RLIMIT_NPROC counts threads), each on a CPU."""
        return self.rlimits()["RLIMIT_CPU"][0] / min(self.max_processes, os.cpu_count() or 1)

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """`resource` limit names and (soft, hard) values applied inside the child. Soft = hard except for CPU
        seconds: SIGXCPU at the soft limit, SIGKILL one second later; the wall clock usually ends it first."""
        mib = 1024 * 1024
        cpu = int(self.timeout_s) + 1
        limits = {
            "RLIMIT_CPU": cpu,
            "RLIMIT_AS": self.memory_mb * mib,
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_NOFILE": self.max_open_files,
            "RLIMIT_FSIZE": self.max_file_mb * mib,
            "RLIMIT_CORE": 0,
        }
        out = {name: (value, value) for name, value in limits.items()}
        out["RLIMIT_CPU"] = (cpu, cpu + 1)
        return out


@dataclass(frozen=True)
class RunResult:
    """What one run did. `stdout` is decoded UTF-8 (invalid bytes replaced); `stderr` is its first
    `STDERR_KEPT` bytes; `returncode` is None when the run was killed."""

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == OK


class _Namespace:
    """The init process of a run's PID namespace, from bwrap's JSON status lines, pinned by a pidfd."""

    def __init__(self) -> None:
        self._buffer = b""
        self._pidfd: int | None = None
        self._pid: int | None = None

    def feed(self, chunk: bytes) -> bool:
        """Take bytes of the status stream; False once nothing more is needed from it."""
        self._buffer += chunk
        while b"\n" in self._buffer and self._pid is None:
            line, self._buffer = self._buffer.split(b"\n", 1)
            try:
                info = json.loads(line)
            except ValueError:
                continue
            if isinstance(info, dict) and "child-pid" in info and "pid-namespace" in info:
                self._pin(int(info["child-pid"]), int(info["pid-namespace"]))
        return bool(chunk) and self._pid is None and len(self._buffer) < 65536

    def _pin(self, pid: int, namespace: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already, or a kernel / Python without pidfds
            pidfd = None
        try:  # the pid must still name a process of the sandbox's namespace (not a recycled pid)
            ok = os.readlink(f"/proc/{pid}/ns/pid") == f"pid:[{namespace}]"
        except OSError:
            ok = False
        if ok:
            self._pid, self._pidfd = pid, pidfd
        elif pidfd is not None:
            os.close(pidfd)

    def kill(self) -> None:
        """SIGKILL the namespace's init: the kernel then kills every process of the namespace."""
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif self._pid is not None:
                os.kill(self._pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # already gone
            pass

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone
        pass


def _kill(proc: subprocess.Popen[bytes], namespace: _Namespace) -> None:
    namespace.kill()
    _killpg(proc.pid)


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (readable once it exits), or None where the kernel or Python has none."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _cpu_limited(returncode: int, via_bwrap: bool, seconds: float, cpu_limit_after_s: float | None) -> bool:
    """Whether an exit means the CPU-seconds limit killed the program (SIGXCPU), not the program's own exit status."""
    if returncode == -signal.SIGXCPU:  # a direct child that the signal killed
        return True
    if not via_bwrap or returncode != 128 + signal.SIGXCPU:  # a direct child's 152 is its own exit status
        return False
    # bwrap says 128 + n for a death by signal n: the limit cannot have fired before a process could use it up.
    return cpu_limit_after_s is None or seconds >= cpu_limit_after_s


def _take_ready(ready_fd: int) -> bool:
    """Whether the ready byte is waiting in `ready_fd` (read without blocking). poll, not select: a busy trainer's
    descriptors pass 1023, which select() refuses (a ValueError that left the run unkilled)."""
    poller = select.poll()
    poller.register(ready_fd, select.POLLIN)
    return bool(poller.poll(0)) and bool(os.read(ready_fd, 1))


def run_captured(
    argv: Sequence[str],
    *,
    stdin_fd: int,
    ready_fd: int,
    pass_fds: Sequence[int],
    timeout_s: float,
    max_output_bytes: int,
    start_timeout_s: float | None = None,
    status_fd: int | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    cpu_limit_after_s: float | None = None,
) -> RunResult:
    """Run `argv` to completion or kill it; see the module docstring for the contract.

    Args:
        argv: the command.
        stdin_fd: file descriptor the child reads as stdin (a regular file or memfd at offset 0).
        ready_fd: read end of a pipe whose write end is in `pass_fds`; the child writes a byte once set up.
        pass_fds: descriptors the child inherits besides stdio; this function closes them (takes ownership).
        timeout_s: wall-clock budget of the program, from the ready byte to its exit.
        start_timeout_s: wall-clock budget from spawn to the ready byte; None: `timeout_s`.
        max_output_bytes: stdout + stderr bytes after which the run is killed.
        status_fd: read end of bwrap's `--json-status-fd` (its write end in `pass_fds`); None without bwrap.
        cwd: working folder of the child. env: its environment (None: inherited; bwrap clears it anyway).
        cpu_limit_after_s: wall seconds from the spawn before which no process of the run can have used up its
            CPU-seconds limit (the limit over the threads a process may run at once); under bwrap a 152 sooner is
            the program's exit status, not SIGXCPU (module docstring). None: every 152 under bwrap is SIGXCPU.
    """
    start = time.monotonic()
    # The start's deadline until the ready byte arrives, then the program's own (see the module docstring).
    deadline = start + (timeout_s if start_timeout_s is None else start_timeout_s)
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=tuple(pass_fds),
            start_new_session=True,
            close_fds=True,
            cwd=cwd,
            env=env,
        )
    except OSError as exc:  # nothing ran (EAGAIN from fork, a missing bwrap): the sandbox failed, not the program
        message = f"could not start the sandbox: {exc!r}"
        return RunResult(SANDBOX_ERROR, "", message, None, time.monotonic() - start)
    finally:  # the child holds them now; our copies would keep the pipes from ever reaching EOF
        for fd in pass_fds:
            os.close(fd)
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    stdout, stderr = bytearray(), bytearray()
    total, ready, status = 0, False, None
    namespace = _Namespace()
    exited_fd = _pidfd(proc.pid)  # readable once the command exits (unreaped: its group id stays its own)
    exited = False
    try:
        with selectors.DefaultSelector() as sel:
            for fd in (out_fd, err_fd, ready_fd, status_fd, exited_fd):
                if fd is not None:
                    sel.register(fd, selectors.EVENT_READ)
            while sel.get_map() and status is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not ready and ready_fd in sel.get_map() and _take_ready(ready_fd):
                    # The byte came at the start's deadline, unread yet: the program starts now, with its own clock.
                    ready, deadline = True, time.monotonic() + timeout_s
                    sel.unregister(ready_fd)
                    continue
                if remaining <= 0:
                    status = TIMEOUT if ready else SANDBOX_ERROR
                    break
                events = sel.select(0 if exited else remaining)
                if exited and not events:
                    break  # the command is gone and its pipes are drained: a detached holder is not waited for
                for key, _ in events:
                    if key.fd == exited_fd:
                        exited = True
                        sel.unregister(exited_fd)
                        continue
                    chunk = os.read(key.fd, 65536)
                    if key.fd == ready_fd:
                        if chunk and not ready:
                            ready, deadline = True, time.monotonic() + timeout_s
                        sel.unregister(ready_fd)  # one byte says it all; EOF would wait for bwrap itself
                        continue
                    if key.fd == status_fd:
                        if not namespace.feed(chunk):  # EOF, or the init is known: the rest is not needed
                            sel.unregister(status_fd)
                        continue
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    total += len(chunk)
                    if total > max_output_bytes:
                        status = OUTPUT_LIMIT
                        break
                    if key.fd == out_fd:
                        stdout += chunk
                    elif len(stderr) < STDERR_KEPT:
                        stderr += chunk[: STDERR_KEPT - len(stderr)]
        if status == OUTPUT_LIMIT and not ready:
            # The budget ran out before the ready byte was read: output the program could not have written (it starts
            # after the byte) is the sandbox's, unless the byte is there, unread, in the same batch.
            ready = _take_ready(ready_fd)
            if not ready:
                status = SANDBOX_ERROR
        returncode: int | None = None
        if status is None:
            if exited:  # not reaped yet, so the group id is still the command's: its group goes with it
                _killpg(proc.pid)
            try:
                returncode = proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:  # closed its pipes but kept running
                status = TIMEOUT
        if status is not None:
            _kill(proc, namespace)
            proc.wait()
    except BaseException:  # anything unforeseen (a KeyboardInterrupt too): no run outlives its reader
        _kill(proc, namespace)
        proc.wait()
        raise
    finally:
        namespace.close()
        if exited_fd is not None:
            os.close(exited_fd)
        proc.stdout.close()
        proc.stderr.close()
    if status is None:
        assert returncode is not None
        if not ready:
            status = SANDBOX_ERROR
        elif returncode == 0:
            status = OK
        elif _cpu_limited(returncode, status_fd is not None, time.monotonic() - start, cpu_limit_after_s):
            status = TIMEOUT
        else:
            status = RUNTIME_ERROR
    return RunResult(
        status=status,
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr.decode("utf-8", "replace"),
        returncode=returncode,
        seconds=time.monotonic() - start,
    )
