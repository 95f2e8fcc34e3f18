"""Kernel interfaces the sandbox's seccomp filter refuses beyond its first table (roll_envs.sandbox.seccomp), each
run as a real program in the sandbox:
- System V semaphore sets and extended attributes: kernel memory no rlimit counts (400 sets of 32000 semaphores
  took 800 MiB in 0.2 s; 500 MiB of xattrs went on one file of the 64 MiB /tmp, whose size cap counts file data
  only), so a run without a cgroup (the usual case without root) could exhaust the trainer's memory;
- virtio sockets (AF_VSOCK): no network namespace confines them, so a program could reach the hypervisor's agents
  from inside an otherwise empty network namespace.
Each is EPERM inside the sandbox while what the standard library does around it keeps working (shutil.copy2 of a
file, listing xattrs, TCP and Unix sockets). Skips where bubblewrap cannot run or there is no filter.
"""

from __future__ import annotations

import json
import platform

import pytest

from roll_envs.sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError, seccomp

EPERM = 1
# The syscalls the programs make, by number (x86-64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: the asm-generic
# table), written out here rather than read from the tables under test.
NUMBERS = {
    "x86_64": {"semget": 64, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463},
    "aarch64": {"semget": 190, "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "setxattrat": 463},
}
NUMBERS["amd64"], NUMBERS["arm64"] = NUMBERS["x86_64"], NUMBERS["aarch64"]


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    if seccomp.filter_program() is None or platform.machine().lower() not in NUMBERS:
        pytest.skip("no seccomp syscall table for this architecture")
    try:
        return PythonSandbox(SandboxLimits(timeout_s=10))
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def _run(sandbox: PythonSandbox, code: str) -> dict[str, object]:
    prelude = (
        "import ctypes, json, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"NR = {json.dumps(NUMBERS[platform.machine().lower()])}\n"
        "def errno_of(name, *args):\n"
        "    ctypes.set_errno(0)\n"
        "    return 0 if libc.syscall(NR[name], *args) >= 0 else ctypes.get_errno()\n"
    )
    result = sandbox.run(prelude + code)
    assert result.ok, result
    return json.loads(result.stdout)


def test_semaphore_sets_are_refused(sandbox: PythonSandbox) -> None:
    got = _run(
        sandbox,
        "IPC_PRIVATE, IPC_CREAT = 0, 0o1000\n"
        # One call, 32000 semaphores (SEMMSL): ~2 MiB of kernel memory, 32000 sets (SEMMNI) per run.
        "print(json.dumps({'semget': errno_of('semget', IPC_PRIVATE, 32000, IPC_CREAT | 0o600)}))\n",
    )
    assert got == {"semget": EPERM}


def test_extended_attributes_are_refused_and_copying_files_still_works(sandbox: PythonSandbox) -> None:
    got = _run(
        sandbox,
        "import shutil\n"
        "open('/tmp/a', 'w').write('data')\n"
        "value = b'x' * 65536\n"
        "fd = os.open('/tmp/a', os.O_RDONLY)\n"
        "class Args(ctypes.Structure):\n"
        "    _fields_ = [('value', ctypes.c_uint64), ('size', ctypes.c_uint32), ('flags', ctypes.c_uint32)]\n"
        "buf = ctypes.create_string_buffer(value, len(value))\n"
        "args = Args(ctypes.addressof(buf), len(value), 0)\n"
        "out = {\n"
        "    'setxattr': errno_of('setxattr', b'/tmp/a', b'user.k', value, len(value), 0),\n"
        "    'lsetxattr': errno_of('lsetxattr', b'/tmp/a', b'user.k', value, len(value), 0),\n"
        "    'fsetxattr': errno_of('fsetxattr', fd, b'user.k', value, len(value), 0),\n"
        "    'setxattrat': errno_of('setxattrat', -100, b'/tmp/a', 0, b'user.k', ctypes.byref(args),\n"
        "                           ctypes.sizeof(args)),\n"
        "    'listxattr': os.listxattr('/tmp/a'),\n"
        "}\n"
        "shutil.copy2('/tmp/a', '/tmp/b')\n"
        "out['copy2'] = open('/tmp/b').read()\n"
        "print(json.dumps(out))\n",
    )
    assert got == {
        "setxattr": EPERM,
        "lsetxattr": EPERM,
        "fsetxattr": EPERM,
        "setxattrat": EPERM,
        "listxattr": [],
        "copy2": "data",
    }


def test_vsock_sockets_are_refused_and_other_families_open(sandbox: PythonSandbox) -> None:
    got = _run(
        sandbox,
        "import socket\n"
        "out = {}\n"
        "for name in ('AF_VSOCK', 'AF_INET', 'AF_UNIX'):\n"
        "    try:\n"
        "        socket.socket(getattr(socket, name), socket.SOCK_STREAM).close()\n"
        "        out[name] = 0\n"
        "    except OSError as e:\n"
        "        out[name] = e.errno\n"
        "print(json.dumps(out))\n",
    )
    assert got == {"AF_VSOCK": EPERM, "AF_INET": 0, "AF_UNIX": 0}
