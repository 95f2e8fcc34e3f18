"""Syscall tables for the sandbox's seccomp filter (roll_envs.sandbox.seccomp): what it refuses, by name, and each
supported architecture's numbers for those names.

Contract: `BLOCKED_NAMES` is the one list of refused syscalls, shared by every architecture; a `SyscallTable` gives
one architecture's audit arch, ABI bit and numbers, and checks on construction that it numbers every blocked name
except those it lists as `absent` (syscalls the architecture never had: nothing to refuse), plus the syscalls the filter
inspects by argument (clone, clone3, prctl, socket). `TABLES` holds the tables by `platform.machine()` name.
A name missing from a table, a number given twice or an unknown name is a ValueError at import, never a filter
that silently lets a syscall through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

#: Refused syscalls by name (seccomp.py's docstring says why each group). Order is documentation only.
BLOCKED_NAMES: tuple[str, ...] = (
    # Tracing other processes, reading or moving their memory, taking their file descriptors.
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise", "kcmp", "move_pages",
    "migrate_pages",
    # Namespaces and mounts, old and new mount API (5.2+; mount_setattr 5.12, open_tree_attr 6.15), file handles.
    "mount", "umount2", "pivot_root", "unshare", "setns", "open_tree", "open_tree_attr", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    # Keyrings, eBPF, perf, fanotify, userfaultfd, io_uring.
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "fanotify_init", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register",
    # Modules, kexec, reboot, swap, accounting, quotas.
    "init_module", "finit_module", "delete_module", "create_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    # The system clock, I/O ports, the kernel log, the terminal.
    "settimeofday", "clock_settime", "clock_adjtime", "iopl", "ioperm", "syslog", "vhangup",
    # Obsolete interfaces (most are ENOSYS on current kernels; old ones may still have them).
    "uselib", "_sysctl", "ustat", "sysfs", "lookup_dcookie", "nfsservctl", "get_kernel_syms", "query_module",
    # Memory outside every rlimit: System V shared memory, semaphore sets (32000 semaphores, ~2 MiB of kernel memory
    # a call) and message queues, memfd files, and extended attributes (a tmpfs keeps them in kernel memory outside
    # its size cap: 500 MiB in 0.2 s on the sandbox's 64 MiB /tmp; setxattrat is Linux 6.13).
    "shmget", "semget", "msgget", "memfd_create", "memfd_secret", "setxattr", "lsetxattr", "fsetxattr", "setxattrat",
)  # fmt: skip
#: Syscalls the filter checks by argument rather than by number alone.
INSPECTED_NAMES = ("clone", "clone3", "prctl", "socket")


@dataclasses.dataclass(frozen=True)
class SyscallTable:
    """One architecture's numbers for `BLOCKED_NAMES` and `INSPECTED_NAMES`.

    Attributes:
        arch: the kernel's name for the architecture (for messages).
        audit_arch: `struct seccomp_data.arch` for native syscalls (linux/audit.h); any other value is killed.
        abi_bit: syscall-number bit that selects another ABI under the same audit arch (x32 on x86-64), killed;
            None where the architecture has none.
        numbers: syscall number by name.
        absent: blocked names the architecture has no syscall for (nothing to refuse).
    """

    arch: str
    audit_arch: int
    abi_bit: int | None
    numbers: Mapping[str, int]
    absent: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        wanted = set(BLOCKED_NAMES) - self.absent
        missing = (wanted | set(INSPECTED_NAMES)) - set(self.numbers)
        extra = set(self.numbers) - wanted - set(INSPECTED_NAMES)
        if missing or extra or not self.absent <= set(BLOCKED_NAMES) or self.absent & set(self.numbers):
            raise ValueError(
                f"{self.arch} syscall table: missing {sorted(missing)}, unknown {sorted(extra)}, "
                f"absent {sorted(self.absent)} (absent names must be blocked names without a number)"
            )
        if len(set(self.numbers.values())) != len(self.numbers):
            raise ValueError(f"{self.arch} syscall table: a number is given twice")

    def blocked(self) -> dict[str, int]:
        """The refused syscalls this architecture has, by name, with their numbers."""
        return {name: self.numbers[name] for name in BLOCKED_NAMES if name in self.numbers}


# x86-64: arch/x86/entry/syscalls/syscall_64.tbl (the 64-bit "common"/"64" rows).
X86_64 = SyscallTable(
    arch="x86_64",
    audit_arch=0xC000003E,  # AUDIT_ARCH_X86_64 = EM_X86_64 (62) | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
    abi_bit=0x40000000,  # __X32_SYSCALL_BIT: x32 syscalls arrive under AUDIT_ARCH_X86_64 with this bit set
    numbers={
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438, "process_madvise": 440,
        "kcmp": 312, "move_pages": 279, "migrate_pages": 256,
        "mount": 165, "umount2": 166, "pivot_root": 155, "unshare": 272, "setns": 308, "open_tree": 428,
        "open_tree_attr": 467, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "open_by_handle_at": 304, "name_to_handle_at": 303,
        "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "fanotify_init": 300,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "init_module": 175, "finit_module": 313, "delete_module": 176, "create_module": 174, "kexec_load": 246,
        "kexec_file_load": 320, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179,
        "quotactl_fd": 443,
        "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "iopl": 172, "ioperm": 173, "syslog": 103,
        "vhangup": 153,
        "uselib": 134, "_sysctl": 156, "ustat": 136, "sysfs": 139, "lookup_dcookie": 212, "nfsservctl": 180,
        "get_kernel_syms": 177, "query_module": 178,
        "shmget": 29, "semget": 64, "msgget": 68, "memfd_create": 319, "memfd_secret": 447, "setxattr": 188,
        "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463,
        "clone": 56, "clone3": 435, "prctl": 157, "socket": 41,
    },
)  # fmt: skip

# arm64 (aarch64): the asm-generic table, include/uapi/asm-generic/unistd.h, checked against Linux 6.1's copy
# (Debian linux-libc-dev 6.1) and scripts/syscall.tbl (where the table lives since 6.11) for open_tree_attr (467,
# Linux 6.15) and setxattrat (463, Linux 6.13, the same number as on x86-64). arm64 defines none of the 16
# architecture-specific slots (244-259) and no x32-like ABI bit: its only other ABI, 32-bit compat tasks, reports
# AUDIT_ARCH_ARM and is killed by the arch check. clone's flags are its first
# argument (arm64 selects CONFIG_CLONE_BACKWARDS: clone(flags, newsp, parent_tid, tls, child_tid), kernel/fork.c;
# only CLONE_BACKWARDS2, s390, moves them), so the clone check reads the same word as on x86-64.
AARCH64 = SyscallTable(
    arch="aarch64",
    audit_arch=0xC00000B7,  # AUDIT_ARCH_AARCH64 = EM_AARCH64 (183) | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
    abi_bit=None,
    numbers={
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438, "process_madvise": 440,
        "kcmp": 272, "move_pages": 239, "migrate_pages": 238,
        "mount": 40, "umount2": 39, "pivot_root": 41, "unshare": 97, "setns": 268, "open_tree": 428,
        "open_tree_attr": 467, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "open_by_handle_at": 265, "name_to_handle_at": 264,
        "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241, "fanotify_init": 262,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294,
        "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "quotactl_fd": 443,
        "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "syslog": 116, "vhangup": 58,
        "lookup_dcookie": 18, "nfsservctl": 42,
        "shmget": 194, "semget": 190, "msgget": 186, "memfd_create": 279, "memfd_secret": 447, "setxattr": 5,
        "lsetxattr": 6, "fsetxattr": 7, "setxattrat": 463,
        "clone": 220, "clone3": 435, "prctl": 167, "socket": 198,
    },
    # Never in the asm-generic table, so an arm64 kernel has no code behind them to reach: iopl and ioperm are x86
    # I/O-port privileges; create_module, get_kernel_syms and query_module predate it (2.6 removed them); uselib,
    # _sysctl and ustat were only under __ARCH_WANT_SYSCALL_DEPRECATED, which arm64 never set;
    # sysfs is there only as ARC's own syscall 247, in a slot arm64 leaves empty.
    absent=frozenset(
        {"iopl", "ioperm", "create_module", "get_kernel_syms", "query_module", "uselib", "_sysctl", "ustat", "sysfs"}
    ),
)  # fmt: skip

#: Tables by `platform.machine().lower()`. Big-endian aarch64 ("aarch64_be") is left out on purpose: the filter
#: reads an argument's low 32 bits at the little-endian offset.
TABLES: dict[str, SyscallTable] = {"x86_64": X86_64, "amd64": X86_64, "aarch64": AARCH64, "arm64": AARCH64}
