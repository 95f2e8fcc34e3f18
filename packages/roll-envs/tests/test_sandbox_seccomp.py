"""The sandbox's seccomp filter (roll_envs.sandbox.seccomp): syscalls a stdin-to-stdout program never needs fail
with EPERM inside the sandbox, ordinary work (files in /tmp, fork, threads) still runs, and without the filter the
same program's ptrace(PTRACE_TRACEME) succeeds (so the test sees the filter, not another layer)."""

from __future__ import annotations

import json

import pytest

from roll_envs.sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError, runner, seccomp

# Each syscall is made raw (libc's syscall()), arguments that would be harmless if it ran; prints the errno of each.
PROBE = """
import ctypes, json, os, threading
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(nr, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(nr, *args)
    return 0 if ret == 0 else ctypes.get_errno()
out = {
    "ptrace_traceme": errno_of(101, 0, 0, 0, 0),
    "unshare_newuts": errno_of(272, 0x04000000),
    "keyctl_get_keyring_id": errno_of(250, 0, -3, 0),
    "userfaultfd": errno_of(323, 0),
    "io_uring_setup": errno_of(425, 1, 0),
}
open("/tmp/f", "w").write("x")
pid = os.fork()
if pid == 0:
    os._exit(7)
t = threading.Thread(target=lambda: None); t.start(); t.join()
out["fork_status"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
out["tmp_file"] = open("/tmp/f").read()
print(json.dumps(out))
"""
TRACEME = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(0 if libc.syscall(101, 0, 0, 0, 0) == 0 else ctypes.get_errno())
"""
EPERM = 1


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
    for name in ("ptrace_traceme", "unshare_newuts", "keyctl_get_keyring_id", "userfaultfd", "io_uring_setup"):
        assert got[name] == EPERM, (name, got)
    assert got["fork_status"] == 7 and got["tmp_file"] == "x"
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
