"""A seccomp filter for sandboxed programs: the kernel interfaces a stdin-to-stdout program never needs fail with
EPERM.

Contract: `filter_program()` returns a classic-BPF seccomp program (the raw `struct sock_filter` array bwrap's
`--seccomp FD` loads, as libseccomp's `seccomp_export_bpf` writes it) for this machine's architecture (x86-64 or
aarch64), or None where roll has no syscall table for it (then runs go without a filter and the log says so once).
Both architectures refuse the same syscalls by name (`_syscalls.BLOCKED_NAMES`; `BLOCKED_X86_64`, `BLOCKED_AARCH64`
give the numbers) through the same program builder. The filter:
- kills the process on a foreign architecture or ABI (a way around a syscall-number filter): x32 on x86-64, 32-bit
  compat tasks (AUDIT_ARCH_ARM) on aarch64;
- returns EPERM for the blocked syscalls, roughly what Docker's default profile refuses a container without extra
  capabilities: tracing and reaching into other processes (ptrace, process_vm_*, pidfd_getfd, process_madvise, kcmp,
  move_pages, migrate_pages), namespaces and mounts (unshare, setns, mount, umount2, pivot_root, the new mount API:
  open_tree, open_tree_attr, move_mount, fsopen, fsconfig, fsmount, fspick, mount_setattr; open_by_handle_at and
  name_to_handle_at), the kernel keyring, eBPF, perf events, fanotify, userfaultfd and io_uring (frequent
  kernel-exploit vectors), module loading, kexec, reboot, swap, accounting and quotas, the clock, I/O ports and the
  kernel log, obsolete interfaces (uselib, _sysctl, ustat, sysfs, ...), and creating System V shared memory,
  semaphore sets and message queues, memfd or secret-memory files, and setting extended attributes (memory no rlimit
  counts: a 256 MiB process held 2 GiB of shared memory, a 128 MiB one 640 MiB of memfd files, 400 semaphore sets
  took 800 MiB of kernel memory in 0.2 s, and 500 MiB of xattrs went on a file of the 64 MiB /tmp, whose size cap
  counts file data only, all where no cgroup caps the run; the standard library uses none of them on its own, and
  shutil.copy2 skips xattrs it may not copy). Most of these fail without capabilities anyway; the filter keeps
  their kernel code (where the exploits live) out of reach, and on kernels too old to have a syscall the filter's
  EPERM replaces ENOSYS;
- returns EPERM for `clone` with any namespace flag (`CLONE_NS_FLAGS`: a new user namespace would hand the program
  every capability inside it; as root there is no sandbox user namespace whose `--disable-userns` stops that), and
  ENOSYS for `clone3` (its flags live in memory a filter cannot read; ENOSYS makes glibc fall back to `clone`);
- returns EPERM for `prctl(PR_SET_PDEATHSIG, ...)`: without root the program is its sandbox's PID 1 and dies with
  bwrap (so with roll) only through the parent-death signal `--die-with-parent` gave it; clearing it would let a
  program outlive a killed trainer, forking fresh CPU-time budgets forever where no cgroup is swept;
- returns EPERM for `socket(AF_VSOCK, ...)`: virtio sockets reach the hypervisor and its other guests (the agents of
  Firecracker, Kata or cloud VMs listen there) and no network namespace confines them (Docker's profile refuses
  them too); every other family is left to the sandbox's empty network namespace;
- allows every other syscall: Python, its standard library, forked children and threads keep working.
bwrap installs it right before it executes the program, after its own set-up.

Why hand-written BPF: libseccomp's Python bindings are not on PyPI as a wheel; a deny-list over one architecture's
syscall numbers is a few instructions. Numbers are from the x86-64 syscall table (arch/x86/entry/syscalls) and the
asm-generic table arm64 uses (include/uapi/asm-generic/unistd.h); sandbox/_syscalls.py cites versions and lists the
x86-only syscalls aarch64 has no number for (iopl, ioperm, uselib, _sysctl, ustat, sysfs, ...: nothing to refuse).
"""

from __future__ import annotations

import functools
import logging
import platform
import struct

from roll_envs.sandbox import _syscalls

log = logging.getLogger(__name__)

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
_RET_ERRNO = 0x00050000
_EPERM, _ENOSYS = 1, 38
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (low half first: little-endian)
_NR_OFFSET, _ARCH_OFFSET, _ARG0_OFFSET = 0, 4, 16

#: Blocked syscalls by name, with each architecture's numbers (the tables live in sandbox/_syscalls.py).
BLOCKED_X86_64 = _syscalls.X86_64.blocked()
BLOCKED_AARCH64 = _syscalls.AARCH64.blocked()
#: prctl's option that would clear the parent-death signal bwrap's `--die-with-parent` gave the program.
PR_SET_PDEATHSIG = 1
#: socket()'s address family of virtio sockets (linux/socket.h): not confined by any network namespace.
AF_VSOCK = 40
#: CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (CLONE_NEWTIME is clone3/unshare only).
CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _program(
    arch: int,
    blocked: list[int],
    abi_bit: int | None,
    clone: tuple[int, int] | None = None,
    prctl: int | None = None,
    socket: int | None = None,
) -> bytes:
    """The filter; `clone` = (clone's, clone3's syscall numbers) adds the namespace-flag check described above,
    `prctl` (its syscall number) the PR_SET_PDEATHSIG check, `socket` (its syscall number) the AF_VSOCK check."""
    deny = _RET_ERRNO | _EPERM
    prog = [
        _insn(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
        _insn(_JEQ_K, 1, 0, arch),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _NR_OFFSET),
    ]
    if abi_bit is not None:
        prog += [_insn(_JGE_K, 0, 1, abi_bit), _insn(_RET_K, 0, 0, _RET_KILL_PROCESS)]
    # Tail after the comparisons: [prctl check (3)] [socket check (3)] [clone checks (5)] ALLOW, EPERM[, ENOSYS];
    # a match jumps to EPERM. Each check loads an argument over the syscall number, so it ends in ALLOW or EPERM.
    clone_checks = 5 if clone is not None else 0
    socket_checks = 3 if socket is not None else 0
    checks = clone_checks + socket_checks + (3 if prctl is not None else 0)
    if len(blocked) + checks > 255:  # a conditional jump's offset is one byte
        raise ValueError(f"{len(blocked)} blocked syscalls: too many for the filter's one-byte jumps")
    for i, nr in enumerate(blocked):
        prog.append(_insn(_JEQ_K, len(blocked) - i + checks, 0, nr))
    rest = socket_checks + clone_checks  # instructions between the prctl check and ALLOW
    if prctl is not None:
        prog += [
            _insn(_JEQ_K, 0, 2, prctl),  # not prctl -> the next check (or ALLOW)
            _insn(_LD_W_ABS, 0, 0, _ARG0_OFFSET),  # the option (an int: the low 32 bits)
            _insn(_JEQ_K, rest + 1, rest, PR_SET_PDEATHSIG),  # -> EPERM, else ALLOW
        ]
    if socket is not None:
        prog += [
            _insn(_JEQ_K, 0, 2, socket),  # not socket -> the clone checks (or ALLOW)
            _insn(_LD_W_ABS, 0, 0, _ARG0_OFFSET),  # the address family (an int: the low 32 bits)
            _insn(_JEQ_K, clone_checks + 1, clone_checks, AF_VSOCK),  # -> EPERM, else ALLOW
        ]
    if clone is not None:
        clone_nr, clone3_nr = clone
        prog += [
            _insn(_JEQ_K, 6, 0, clone3_nr),  # -> ENOSYS
            _insn(_JEQ_K, 0, 3, clone_nr),  # not clone -> ALLOW
            _insn(_LD_W_ABS, 0, 0, _ARG0_OFFSET),  # clone's flags (the low 32 bits hold every CLONE_NEW*)
            _insn(_AND_K, 0, 0, CLONE_NS_FLAGS),
            _insn(_JEQ_K, 0, 1, 0),  # no namespace flag -> ALLOW, else EPERM
        ]
    prog += [_insn(_RET_K, 0, 0, _RET_ALLOW), _insn(_RET_K, 0, 0, deny)]
    if clone is not None:
        prog.append(_insn(_RET_K, 0, 0, _RET_ERRNO | _ENOSYS))
    return b"".join(prog)


def program_for(table: _syscalls.SyscallTable) -> bytes:
    """The filter for one architecture's syscall table: its blocked syscalls, clone/clone3, prctl and socket
    checks."""
    numbers = table.numbers
    return _program(
        table.audit_arch,
        sorted(table.blocked().values()),
        table.abi_bit,
        (numbers["clone"], numbers["clone3"]),
        numbers["prctl"],
        numbers["socket"],
    )


@functools.lru_cache(maxsize=1)
def filter_program() -> bytes | None:
    """The compiled filter for this machine, or None where roll has no syscall table for its architecture."""
    machine = platform.machine().lower()
    table = _syscalls.TABLES.get(machine)
    if table is not None:
        return program_for(table)
    log.warning("no seccomp syscall table for %s: sandboxed programs run without a syscall filter", machine)
    return None
