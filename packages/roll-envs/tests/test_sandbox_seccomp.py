"""The sandbox's seccomp filter (roll_envs.sandbox.seccomp): syscalls a stdin-to-stdout program never needs fail
with EPERM inside the sandbox (clone with a namespace flag and System V IPC creation too, clone3 with ENOSYS),
ordinary work (files in /tmp, fork, threads, subprocesses) still runs, and without the filter the same program's
ptrace(PTRACE_TRACEME) succeeds (so the test sees the filter, not another layer). The mount API, reaching into other
processes, the clock, obsolete syscalls... (Docker's default denials) get EPERM too, where the kernel alone would
have answered otherwise, and the filter, evaluated instruction by instruction, refuses exactly its table. The
aarch64 filter (this machine is x86-64) is checked by the same classic-BPF interpreter, itself held to the answers
the kernel gives the x86-64 filter in the sandbox."""

from __future__ import annotations

import json
import platform
import struct

import pytest

from roll_envs.sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError, _syscalls, runner, seccomp

# Each syscall is made raw (libc's syscall()), arguments that would be harmless if it ran; prints the errno of each.
PROBE = """
import ctypes, json, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(nr, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(nr, *args)
    return 0 if ret == 0 else ctypes.get_errno()
def clone_errno(flags):  # raw clone(flags | SIGCHLD): the child (if any) exits at once
    ctypes.set_errno(0)
    pid = libc.syscall(56, flags | 17, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
        return 0
    return ctypes.get_errno()
out = {
    "clone_newuser": clone_errno(0x10000000),
    "clone_newuser_newns_newnet": clone_errno(0x10000000 | 0x20000 | 0x40000000),
    "clone_newpid": clone_errno(0x20000000),
    "clone_plain": clone_errno(0),
    "clone3": errno_of(435, 0, 0),
    "ptrace_traceme": errno_of(101, 0, 0, 0, 0),
    "unshare_newuts": errno_of(272, 0x04000000),
    "keyctl_get_keyring_id": errno_of(250, 0, -3, 0),
    "userfaultfd": errno_of(323, 0),
    "io_uring_setup": errno_of(425, 1, 0),
    "shmget_private": errno_of(29, 0, 64 << 20, 0o1000 | 0o600),
    "msgget_private": errno_of(68, 0, 0o1000 | 0o600),
    "memfd_create": errno_of(319, b"x", 0),
    "prctl_clear_pdeathsig": errno_of(157, 1, 0),
    "prctl_set_name": errno_of(157, 15, b"probe"),
}
open("/tmp/f", "w").write("x")
pid = os.fork()
if pid == 0:
    os._exit(7)
t = threading.Thread(target=lambda: None); t.start(); t.join()
out["fork_status"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
out["tmp_file"] = open("/tmp/f").read()
out["subprocess"] = subprocess.run(["/bin/echo", "spawned"], capture_output=True, text=True).stdout.strip()
print(json.dumps(out))
"""
TRACEME = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(0 if libc.syscall(101, 0, 0, 0, 0) == 0 else ctypes.get_errno())
"""
# Syscalls in the family Docker's default profile refuses, each with arguments that are harmless if it runs. Without
# the filter the kernel answers those in `KERNEL_ALLOWS` with something other than EPERM (a result, EBADF, EINVAL,
# or ENOSYS where a kernel lacks it), so their EPERM is the filter's; the others are refused anyway to a program
# without capabilities (there the filter keeps their kernel code out of reach: `test_the_filter_decides_...`).
FAMILY_PROBE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def errno_of(nr, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(nr, *args)
    if ret >= 0 and nr in (428, 467):  # open_tree(_attr) hands back a file descriptor
        os.close(ret)
    return 0 if ret >= 0 else ctypes.get_errno()
AT_FDCWD = -100
print(json.dumps({
    "open_tree": errno_of(428, AT_FDCWD, b"/tmp", 0),
    "open_tree_attr": errno_of(467, AT_FDCWD, b"/tmp", 0, None, 0),
    "move_mount": errno_of(429, -1, b"", -1, b"", 0xFFFFFFFF),
    "fsopen": errno_of(430, b"tmpfs", 0),
    "fsconfig": errno_of(431, -1, 0xFF, None, None, 0),
    "fsmount": errno_of(432, -1, 0xFFFFFFFF, 0),
    "fspick": errno_of(433, AT_FDCWD, b"/tmp", 0xFFFFFFFF),
    "mount_setattr": errno_of(442, -1, b"", 0xFFFFFFFF, None, 0),
    "pidfd_getfd": errno_of(438, -1, 0, 0),
    "process_madvise": errno_of(440, -1, None, 0, 0, 0),
    "kcmp": errno_of(312, os.getpid(), os.getpid(), 0, 0, 0),
    "move_pages": errno_of(279, 0, 0, None, None, None, 0),
    "migrate_pages": errno_of(256, 0, 0, None, None),
    "clock_settime": errno_of(227, 0xFFFF, None),
    "clock_adjtime": errno_of(305, 0xFFFF, None),
    "settimeofday": errno_of(164, None, None),
    "syslog": errno_of(103, 10, None, 0),
    "fanotify_init": errno_of(300, 0xFFFFFFFF, 0),
    "quotactl_fd": errno_of(443, -1, 0, 0, None),
    "memfd_secret": errno_of(447, 0xFFFFFFFF),
    "iopl": errno_of(172, 0),
    "ioperm": errno_of(173, 0, 0, 0),
    "uselib": errno_of(134, None),
    "_sysctl": errno_of(156, None),
    "ustat": errno_of(136, 0, None),
    "sysfs": errno_of(139, 3),
    "lookup_dcookie": errno_of(212, 0, None, 0),
    "name_to_handle_at": errno_of(303, AT_FDCWD, b"/tmp", None, None, 0),
}))
"""
KERNEL_ALLOWS = (
    "open_tree", "open_tree_attr", "fsconfig", "mount_setattr", "pidfd_getfd", "process_madvise", "kcmp",
    "move_pages", "migrate_pages", "clock_settime", "clock_adjtime", "quotactl_fd", "memfd_secret", "uselib",
    "_sysctl", "ustat", "sysfs",
)  # fmt: skip
# An ordinary program touching what the standard library does: files, directories, sockets pairs, sqlite, asyncio.
ORDINARY = """
import asyncio, json, os, socket, sqlite3, tempfile, time
with tempfile.TemporaryDirectory() as d:
    open(os.path.join(d, "a"), "w").write("x")
    listed = os.listdir(d)
db = sqlite3.connect(":memory:"); db.execute("create table t (x)"); db.execute("insert into t values (3)")
a, b = socket.socketpair(); a.sendall(b"ping"); got = b.recv(4).decode()
async def main():
    await asyncio.sleep(0)
    return 5
print(json.dumps({"listed": listed, "sql": db.execute("select x from t").fetchone()[0], "pair": got,
                  "async": asyncio.run(main()), "clock": time.time() > 0}))
"""
EPERM, ENOSYS = 1, 38
ALLOW, KILL = 0x7FFF0000, 0x80000000
X86_64, AARCH64, ARM = 0xC000003E, 0xC00000B7, 0x40000028  # AUDIT_ARCH_* (linux/audit.h)
SIGCHLD, CLONE_NEWUSER, CLONE_THREAD_FLAGS = 17, 0x10000000, 0x003D0F00  # glibc's flags for a pthread
# PROBE's cases: the syscall by name, its arguments (0 for a pointer the filter never reads), and what the sandbox
# answers (0: it ran). The live test checks the kernel's answers; the interpreter must give the same on the filter.
PROBE_CASES: dict[str, tuple[str, tuple[int, ...], int]] = {
    "clone_newuser": ("clone", (CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0), EPERM),
    "clone_newuser_newns_newnet": ("clone", (CLONE_NEWUSER | 0x20000 | 0x40000000 | SIGCHLD, 0, 0, 0, 0), EPERM),
    "clone_newpid": ("clone", (0x20000000 | SIGCHLD, 0, 0, 0, 0), EPERM),
    "clone_plain": ("clone", (SIGCHLD, 0, 0, 0, 0), 0),
    "clone3": ("clone3", (0, 0), ENOSYS),
    "ptrace_traceme": ("ptrace", (0, 0, 0, 0), EPERM),
    "unshare_newuts": ("unshare", (0x04000000,), EPERM),
    "keyctl_get_keyring_id": ("keyctl", (0, -3, 0), EPERM),
    "userfaultfd": ("userfaultfd", (0,), EPERM),
    "io_uring_setup": ("io_uring_setup", (1, 0), EPERM),
    "shmget_private": ("shmget", (0, 64 << 20, 0o1000 | 0o600), EPERM),
    "msgget_private": ("msgget", (0, 0o1000 | 0o600), EPERM),
    "memfd_create": ("memfd_create", (0, 0), EPERM),
    "prctl_clear_pdeathsig": ("prctl", (1, 0), EPERM),
    "prctl_set_name": ("prctl", (15, 0), 0),
}


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    if seccomp.filter_program() is None:
        pytest.skip("no seccomp syscall table for this architecture (x86-64 only)")
    try:
        return PythonSandbox(SandboxLimits(timeout_s=10))
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def _probe(sandbox: PythonSandbox) -> dict[str, object]:
    result = sandbox.run(PROBE)
    assert result.ok, result
    return json.loads(result.stdout)


def test_blocked_syscalls_fail_with_eperm_and_ordinary_work_runs(
    sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = _probe(sandbox)
    # Every case as PROBE_CASES says (the interpreter test holds the BPF interpreter to the same answers).
    assert {name: got[name] for name in PROBE_CASES} == {name: err for name, (_, _, err) in PROBE_CASES.items()}
    blocked = ("ptrace_traceme", "unshare_newuts", "keyctl_get_keyring_id", "userfaultfd", "io_uring_setup")
    # System V shared memory, message queues and memfd files: memory outside every rlimit (without a cgroup,
    # unbounded: a 128 MiB process held 640 MiB in memfd files).
    for name in (*blocked, "shmget_private", "msgget_private", "memfd_create"):
        assert got[name] == EPERM, (name, got)
    # Clearing the parent-death signal would let a program outlive a killed trainer; other prctl options work.
    assert got["prctl_clear_pdeathsig"] == EPERM and got["prctl_set_name"] == 0, got
    assert got["fork_status"] == 7 and got["tmp_file"] == "x" and got["subprocess"] == "spawned"
    # A new user namespace would give the program every capability inside it (as root there is no sandbox user
    # namespace whose --disable-userns stops it): clone with any namespace flag is refused; clone3 (flags out of
    # the filter's reach) is ENOSYS, so glibc falls back to clone for threads and spawns.
    for name in ("clone_newuser", "clone_newuser_newns_newnet", "clone_newpid"):
        assert got[name] == EPERM, (name, got)
    assert got["clone_plain"] == 0 and got["clone3"] == ENOSYS, got
    # Without the filter the sandbox's other layers allow PTRACE_TRACEME: the EPERM above is the filter's. (Alone:
    # a process traced by the sandbox's init must not fork afterwards, its children's signals would stop it.)
    monkeypatch.setattr(runner, "filter_program", lambda: None)
    alone = sandbox.run(TRACEME)
    assert alone.ok and alone.stdout.strip() == "0", alone


def test_the_filter_program_is_well_formed() -> None:
    program = seccomp._program(0xC000003E, [101, 272], 0x40000000)
    assert len(program) % 8 == 0
    insns = [program[i : i + 8] for i in range(0, len(program), 8)]
    # load arch, arch check, kill, load nr, x32 check, kill, 2 comparisons, allow, deny
    assert len(insns) == 10
    code, jt, jf, k = struct.unpack("=HBBI", insns[6])
    assert (code, jt, jf, k) == (0x15, 2, 0, 101)  # a match jumps over the other comparison and ALLOW, to EPERM
    assert struct.unpack("=HBBI", insns[-1])[3] == 0x00050001 and struct.unpack("=HBBI", insns[-2])[3] == 0x7FFF0000
    # With the clone check: 2 comparisons, clone3, clone, load flags, and, test, allow, deny, enosys.
    program = seccomp._program(0xC000003E, [101, 272], 0x40000000, (56, 435))
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    assert len(insns) == 16
    assert insns[6] == (0x15, 7, 0, 101) and insns[7] == (0x15, 6, 0, 272)  # to EPERM, past the clone check
    assert insns[8] == (0x15, 6, 0, 435) and insns[9] == (0x15, 0, 3, 56)
    assert insns[10] == (0x20, 0, 0, 16) and insns[11] == (0x54, 0, 0, seccomp.CLONE_NS_FLAGS)
    assert insns[12] == (0x15, 0, 1, 0)
    assert [k for *_, k in insns[13:]] == [0x7FFF0000, 0x00050001, 0x00050026]
    # With the prctl check too: it sits between the comparisons and the clone check, and ends in ALLOW or EPERM.
    program = seccomp._program(0xC000003E, [101, 272], 0x40000000, (56, 435), 157)
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    assert len(insns) == 19
    assert insns[6] == (0x15, 10, 0, 101) and insns[7] == (0x15, 9, 0, 272)  # to EPERM (index 17)
    assert insns[8] == (0x15, 0, 2, 157) and insns[9] == (0x20, 0, 0, 16)  # not prctl: on to the clone check
    assert insns[10] == (0x15, 6, 5, 1)  # PR_SET_PDEATHSIG -> EPERM (17), any other option -> ALLOW (16)
    assert insns[11] == (0x15, 6, 0, 435) and [k for *_, k in insns[16:]] == [0x7FFF0000, 0x00050001, 0x00050026]


def test_the_mount_api_and_other_privileged_syscalls_fail_with_eperm(
    sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = sandbox.run(FAMILY_PROBE)
    assert result.ok, result
    got = json.loads(result.stdout)
    refused = {name: err for name, err in got.items() if err == EPERM}
    assert refused == got, {name: err for name, err in got.items() if err != EPERM}
    # Ordinary work still runs under the longer filter.
    ordinary = sandbox.run(ORDINARY)
    assert ordinary.ok, ordinary
    assert json.loads(ordinary.stdout) == {"listed": ["a"], "sql": 3, "pair": "ping", "async": 5, "clock": True}
    # Without the filter the kernel answers these otherwise (open_tree hands back a descriptor, fsconfig on a bad fd
    # is EINVAL, kcmp compares two descriptors...): the EPERM above is the filter's.
    monkeypatch.setattr(runner, "filter_program", lambda: None)
    alone = sandbox.run(FAMILY_PROBE)
    assert alone.ok, alone
    unfiltered = json.loads(alone.stdout)
    assert all(unfiltered[name] != EPERM for name in KERNEL_ALLOWS), unfiltered


def _run_bpf(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """Interpret a classic-BPF seccomp `program` over one `struct seccomp_data` (int nr; u32 arch; u64
    instruction_pointer; u64 args[6], little-endian as on x86-64 and aarch64): the action it returns. It knows the
    opcodes `seccomp._program` emits and refuses any other, an out-of-bounds load or jump, or running off the end."""
    if len(program) % 8 or not program:
        raise AssertionError(f"a BPF program is whole 8-byte instructions, got {len(program)} bytes")
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(a & 0xFFFFFFFFFFFFFFFF for a in (*args, 0, 0, 0, 0, 0, 0)[:6]))
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while pc < len(insns):
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS: a 32-bit word of seccomp_data (the kernel's own byte order)
            if k % 4 or k + 4 > len(data):
                raise AssertionError(f"load at offset {k}")
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            acc &= k
        elif code in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE | BPF_K
            pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
    raise AssertionError("the program ran off its end (the kernel refuses such a filter)")


def _decide(program: bytes, nr: int, arch: int = X86_64, arg0: int = 0) -> int:
    """Run the classic-BPF `program` on one syscall: its return value."""
    return _run_bpf(program, nr, arch, (arg0,))


def _verdict(action: int) -> int | str:
    """A seccomp action as the program sees it: 0 where the syscall runs, the errno of RET_ERRNO, or "kill"."""
    if action == ALLOW:
        return 0
    if action & 0xFFFF0000 == 0x00050000:
        return action & 0xFFFF
    assert action == KILL, hex(action)
    return "kill"


def test_the_filter_decides_every_blocked_syscall_and_allows_the_rest() -> None:
    """Evaluated instruction by instruction: each entry of the table (those a capability-less program is refused by
    the kernel anyway too) is EPERM, the rest of the x86-64 table up to 470 is allowed, foreign ABIs are killed."""
    program = seccomp._program(0xC000003E, sorted(seccomp.BLOCKED_X86_64.values()), 0x40000000, (56, 435), 157, 41)
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert seccomp.filter_program() == program  # the filter bwrap loads here
    new = ("open_tree", "open_tree_attr", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr")
    new += ("pidfd_getfd", "process_madvise", "kcmp", "move_pages", "migrate_pages", "settimeofday", "clock_settime")
    new += ("clock_adjtime", "iopl", "ioperm", "syslog", "vhangup", "fanotify_init", "quotactl_fd", "memfd_secret")
    new += ("uselib", "_sysctl", "ustat", "sysfs", "lookup_dcookie", "nfsservctl", "create_module")
    assert set(new) <= set(seccomp.BLOCKED_X86_64), set(new) - set(seccomp.BLOCKED_X86_64)
    assert len(set(seccomp.BLOCKED_X86_64.values())) == len(seccomp.BLOCKED_X86_64)  # no number twice
    blocked = set(seccomp.BLOCKED_X86_64.values())
    for name, nr in seccomp.BLOCKED_X86_64.items():
        assert _decide(program, nr) == 0x00050001, name
    for nr in set(range(471)) - blocked - {435}:
        assert _decide(program, nr) == 0x7FFF0000, nr
    assert _decide(program, 435) == 0x00050026  # clone3: ENOSYS
    assert _decide(program, 56, arg0=0x10000000) == 0x00050001 and _decide(program, 157, arg0=1) == 0x00050001
    assert _decide(program, 41, arg0=40) == 0x00050001 and _decide(program, 41, arg0=1) == 0x7FFF0000  # AF_VSOCK
    assert _decide(program, 0, arch=0x40000003) == 0x80000000 and _decide(program, 0x40000000 | 1) == 0x80000000
    with pytest.raises(ValueError, match="one-byte jumps"):
        seccomp._program(0xC000003E, list(range(300)), 0x40000000)


# x86-64 numbers PROBE calls (arch/x86/entry/syscalls/syscall_64.tbl), and aarch64 numbers checked by hand against
# the asm-generic table arm64 uses (include/uapi/asm-generic/unistd.h, Linux 6.1; open_tree_attr: 6.15).
KERNEL_X86_64 = {
    "clone": 56, "clone3": 435, "prctl": 157, "ptrace": 101, "unshare": 272, "keyctl": 250, "userfaultfd": 323,
    "io_uring_setup": 425, "shmget": 29, "msgget": 68, "memfd_create": 319,
}  # fmt: skip
KERNEL_AARCH64 = {
    "clone": 220, "clone3": 435, "prctl": 167, "ptrace": 117, "unshare": 97, "keyctl": 219, "userfaultfd": 282,
    "io_uring_setup": 425, "shmget": 194, "msgget": 186, "memfd_create": 279, "mount": 40, "umount2": 39,
    "pivot_root": 41, "setns": 268, "bpf": 280, "perf_event_open": 241, "kexec_load": 104, "init_module": 105,
    "reboot": 142, "settimeofday": 170, "clock_settime": 112, "syslog": 116, "process_vm_readv": 270,
    "move_pages": 239, "open_tree_attr": 467, "memfd_secret": 447, "vhangup": 58, "lookup_dcookie": 18,
}  # fmt: skip
# Everyday aarch64 syscalls (same table) the filter must let through: a Python program makes these all the time.
AARCH64_EVERYDAY = {
    "read": 63, "write": 64, "openat": 56, "close": 57, "exit_group": 94, "mmap": 222, "munmap": 215, "brk": 214,
    "mprotect": 226, "futex": 98, "execve": 221, "wait4": 260, "getpid": 172, "newfstatat": 79, "rt_sigaction": 134,
    "pipe2": 59, "socket": 198, "getrandom": 278, "set_robust_list": 99, "rseq": 293,
}  # fmt: skip


@pytest.fixture
def fresh_filter_program():
    """`filter_program` recomputed for a patched `platform.machine`, and its cache emptied again afterwards."""
    seccomp.filter_program.cache_clear()
    yield seccomp.filter_program
    seccomp.filter_program.cache_clear()


def test_the_interpreter_agrees_with_the_kernel_on_the_x86_64_filter() -> None:
    """PROBE_CASES are what the kernel answered in the sandbox (test_blocked_syscalls_...); the interpreter must give
    the same answers on the x86-64 filter, so its verdicts on the aarch64 filter can be trusted."""
    table = _syscalls.X86_64
    assert {name: table.numbers[name] for name in KERNEL_X86_64} == KERNEL_X86_64
    program = seccomp.program_for(table)
    for case, (name, args, errno) in PROBE_CASES.items():
        assert _verdict(_run_bpf(program, table.numbers[name], X86_64, args)) == errno, case
    assert _verdict(_run_bpf(program, 56, X86_64, (CLONE_THREAD_FLAGS,))) == 0  # a thread's clone runs


def test_aarch64_gets_a_filter_refusing_the_same_syscalls(
    monkeypatch: pytest.MonkeyPatch, fresh_filter_program
) -> None:
    """On an Arm machine (Graviton, Neoverse) the sandbox loads an aarch64 filter (it ran without one): the blocked
    syscalls by their aarch64 numbers are EPERM, everyday ones run, clone with a namespace flag is EPERM and clone3
    ENOSYS, clearing the parent-death signal is EPERM, and 32-bit compat (or any other arch) is killed."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    program = fresh_filter_program()
    assert program is not None, "no seccomp filter for aarch64"
    blocked = seccomp.BLOCKED_AARCH64
    # The same names as on x86-64, less those aarch64 never had (nothing to refuse there).
    absent = {"iopl", "ioperm", "uselib", "_sysctl", "ustat", "sysfs", "create_module", "get_kernel_syms"}
    absent |= {"query_module"}
    assert set(blocked) == set(seccomp.BLOCKED_X86_64) - absent and _syscalls.AARCH64.absent == absent
    numbers = _syscalls.AARCH64.numbers
    assert {name: numbers[name] for name in KERNEL_AARCH64} == KERNEL_AARCH64
    assert not set(AARCH64_EVERYDAY.values()) & set(blocked.values())
    # Evaluated instruction by instruction: every blocked syscall is EPERM, the rest of the table up to 470 runs.
    for name, nr in blocked.items():
        assert _verdict(_run_bpf(program, nr, AARCH64)) == EPERM, name
    for nr in set(range(471)) - set(blocked.values()) - {435}:
        assert _verdict(_run_bpf(program, nr, AARCH64)) == 0, nr
    for name, nr in AARCH64_EVERYDAY.items():
        assert _verdict(_run_bpf(program, nr, AARCH64, (3, 0, 0))) == 0, name
    # The probe's cases, by their aarch64 numbers, get the answers the x86-64 sandbox gives.
    for case, (name, args, errno) in PROBE_CASES.items():
        assert _verdict(_run_bpf(program, numbers[name], AARCH64, args)) == errno, case
    assert _verdict(_run_bpf(program, 220, AARCH64, (CLONE_NEWUSER | SIGCHLD,))) == EPERM
    assert _verdict(_run_bpf(program, 220, AARCH64, (SIGCHLD,))) == 0
    assert _verdict(_run_bpf(program, 220, AARCH64, (CLONE_THREAD_FLAGS,))) == 0
    assert _verdict(_run_bpf(program, 435, AARCH64)) == ENOSYS
    assert _verdict(_run_bpf(program, 167, AARCH64, (1, 0))) == EPERM
    assert _verdict(_run_bpf(program, 167, AARCH64, (15, 0))) == 0
    assert _verdict(_run_bpf(program, 198, AARCH64, (40, 1, 0))) == EPERM  # socket(AF_VSOCK, ...)
    # 32-bit compat tasks (AUDIT_ARCH_ARM: other syscall numbers) and x86-64 numbers are killed, whatever the call.
    for nr in (0, 26, 63, 117, 220):
        assert _verdict(_run_bpf(program, nr, ARM)) == "kill", nr
        assert _verdict(_run_bpf(program, nr, X86_64)) == "kill", nr
    # And the x86-64 filter kills aarch64 syscalls.
    assert _verdict(_run_bpf(seccomp.program_for(_syscalls.X86_64), 63, AARCH64)) == "kill"
    monkeypatch.setattr(platform, "machine", lambda: "arm64")  # the name some systems give it
    fresh_filter_program.cache_clear()
    assert fresh_filter_program() == program
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")  # no table: no filter, said in the log
    fresh_filter_program.cache_clear()
    assert fresh_filter_program() is None


def test_a_syscall_table_missing_a_blocked_name_is_refused() -> None:
    """A table that forgets a blocked syscall (or gives two one number: unshare's 97 for bpf) is an error, never a
    filter that allows it."""
    numbers = dict(_syscalls.AARCH64.numbers)
    del numbers["bpf"]
    with pytest.raises(ValueError, match=r"missing \['bpf'\]"):
        _syscalls.SyscallTable("aarch64", AARCH64, None, numbers, _syscalls.AARCH64.absent)
    with pytest.raises(ValueError, match="twice"):
        _syscalls.SyscallTable("aarch64", AARCH64, None, {**numbers, "bpf": 97}, _syscalls.AARCH64.absent)
