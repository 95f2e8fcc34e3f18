"""The sandbox's seccomp filter (roll_envs.sandbox.seccomp): syscalls a stdin-to-stdout program never needs fail
with EPERM inside the sandbox (clone with a namespace flag and System V IPC creation too, clone3 with ENOSYS),
ordinary work (files in /tmp, fork, threads, subprocesses) still runs, and without the filter the same program's
ptrace(PTRACE_TRACEME) succeeds (so the test sees the filter, not another layer). The mount API, reaching into other
processes, the clock, obsolete syscalls... (Docker's default denials) get EPERM too, where the kernel alone would
have answered otherwise, and the filter, evaluated instruction by instruction, refuses exactly its table."""

from __future__ import annotations

import json
import platform
import struct

import pytest

from roll_envs.sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError, runner, seccomp

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


def _decide(program: bytes, nr: int, arch: int = 0xC000003E, arg0: int = 0) -> int:
    """Run the classic-BPF `program` (the instructions `seccomp._program` emits) on one syscall: its return value."""
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    data = {0: nr, 4: arch, 16: arg0 & 0xFFFFFFFF}
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:
            acc = data[k]
        elif code == 0x54:
            acc &= k
        elif code in (0x15, 0x35):
            pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


def test_the_filter_decides_every_blocked_syscall_and_allows_the_rest() -> None:
    """Evaluated instruction by instruction: each entry of the table (those a capability-less program is refused by
    the kernel anyway too) is EPERM, the rest of the x86-64 table up to 470 is allowed, foreign ABIs are killed."""
    program = seccomp._program(0xC000003E, sorted(seccomp.BLOCKED_X86_64.values()), 0x40000000, (56, 435), 157)
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
    assert _decide(program, 0, arch=0x40000003) == 0x80000000 and _decide(program, 0x40000000 | 1) == 0x80000000
    with pytest.raises(ValueError, match="one-byte jumps"):
        seccomp._program(0xC000003E, list(range(300)), 0x40000000)
