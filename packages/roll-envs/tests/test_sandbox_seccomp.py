"""The sandbox's seccomp filter (roll_envs.sandbox.seccomp): syscalls a stdin-to-stdout program never needs fail
with EPERM inside the sandbox (clone with a namespace flag and System V IPC creation too, clone3 with ENOSYS),
ordinary work (files in /tmp, fork, threads, subprocesses) still runs, and without the filter the same program's
ptrace(PTRACE_TRACEME) succeeds (so the test sees the filter, not another layer)."""

from __future__ import annotations

import json

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
    import struct

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
