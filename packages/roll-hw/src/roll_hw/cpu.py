"""The CPU platform: always available, gloo collectives, host memory from /proc (no psutil needed).

Also `tune_host_allocator()`: the glibc malloc settings CPU engine processes run with (see its docstring), and
`fp32_linear_library()`: which matmul library the CPU engines' fp32 linears use (oneDNN or MKL; see its docstring),
`bound_onednn_caches()`: the oneDNN cache sizes engine processes run with, and `usable_cpu_count()`: the CPUs
this process may keep busy (affinity and cgroup CPU quota; `os.cpu_count()` is the host's).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import platform as _pyplatform
from typing import ClassVar

from roll_hw.interface import MemoryStats, Platform


def _meminfo() -> dict[str, int]:
    """Parse /proc/meminfo into bytes; empty on systems without it."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except OSError:
        pass
    return out


def _rss_bytes() -> int:
    """Resident set size of this process, in bytes (0 when unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


#: Where the cgroup file systems are mounted, and this process's cgroup list (module attributes: tests point them at
#: a folder of their own).
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
#: cgroup v1 reports "no limit" as a page-rounded 2**63: anything from 2**60 up is no limit.
_NO_LIMIT = 2**60


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2's "max": no limit


def _stat_value(path: str, key: str) -> int:
    """One `key value` line of a cgroup memory.stat file (0 where absent)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def _cgroup_paths() -> dict[str, str] | None:
    """This process's cgroup per v1 controller ("memory", "cpu", ...) and "" for the v2 hierarchy (None: unknown)."""
    try:
        with open(PROC_SELF_CGROUP) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    return {c: p for _, controllers, p in (x for x in lines if len(x) == 3) for c in controllers.split(",")}


def _cgroup_leaf(base: str, rel: str) -> str:
    """The folder of cgroup `rel` under the mount `base`; `base` itself where a cgroup namespace names another."""
    leaf = os.path.normpath(f"{base}{rel}")
    return leaf if (leaf == base or leaf.startswith(base + os.sep)) and os.path.isdir(leaf) else base


def _up_to(base: str, leaf: str) -> list[str]:
    """`leaf` and each folder above it, up to and including `base`."""
    out = [leaf]
    while len(out[-1]) > len(base):
        out.append(os.path.dirname(out[-1]))
    return out


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of run time the cgroup quota allows this process (Docker `--cpus`, a Kubernetes CPU limit, a
    systemd `CPUQuota=`), the smallest from its cgroup up; None where no quota applies. cgroup v2 `cpu.max`
    ("<quota> <period>" or "max <period>") and v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none) are read."""
    paths = _cgroup_paths()
    if paths is None:
        return None
    quotas: list[float] = []
    if "cpu" in paths:  # v1 (also v1 cpu beside a v2 hierarchy)
        base = f"{CGROUP_ROOT}/cpu"
        for folder in _up_to(base, _cgroup_leaf(base, paths["cpu"])):
            quota, period = _read_text(f"{folder}/cpu.cfs_quota_us"), _read_text(f"{folder}/cpu.cfs_period_us")
            if quota and period and quota.isdigit() and period.isdigit() and int(period) > 0:
                quotas.append(int(quota) / int(period))
    elif "" in paths:  # v2
        for folder in _up_to(CGROUP_ROOT, _cgroup_leaf(CGROUP_ROOT, paths[""])):
            fields = (_read_text(f"{folder}/cpu.max") or "").split()
            if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]) > 0:
                quotas.append(int(fields[0]) / int(fields[1]))
    return min(quotas, default=None)


def usable_cpu_count() -> int:
    """CPUs this process can keep busy: its affinity mask (taskset, Slurm, Docker `--cpuset-cpus`), lowered to its
    cgroup CPU quota rounded up (`cgroup_cpu_quota`); at least 1. `os.cpu_count()` is the host's: a pod limited to
    2 CPUs on a 64-core node that ran 64 threads was throttled for most of every period."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call (macOS)
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)


def cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) in bytes of the memory cgroup this process runs in, or None where no limit applies.

    A container's memory limit (Docker `--memory`, a Kubernetes pod's limit, a Slurm job, a systemd slice) is its
    memory: /proc/meminfo shows the host's, so a pod limited to 16 GiB on a 1 TiB node reported ~1 TiB free. cgroup
    v1 (`memory.stat`'s hierarchical_memory_limit: ancestors' limits included) and v2 (the smallest `memory.max` from
    this process's cgroup up) are read; usage leaves out inactive file cache, which the kernel reclaims before it
    kills (as `docker stats` and Ray count it).
    """
    paths = _cgroup_paths()
    if paths is None:
        return None
    if "memory" in paths:  # v1 (also v1 memory beside a v2 hierarchy: "hybrid")
        # A cgroup namespace mounts the process's own cgroup as the root, and names it relative to another one.
        leaf = _cgroup_leaf(f"{CGROUP_ROOT}/memory", paths["memory"])
        limit = _stat_value(f"{leaf}/memory.stat", "hierarchical_memory_limit") or _read_int(
            f"{leaf}/memory.limit_in_bytes"
        )
        usage = _read_int(f"{leaf}/memory.usage_in_bytes")
        inactive = _stat_value(f"{leaf}/memory.stat", "total_inactive_file")
    elif "" in paths:  # v2 only
        leaf = _cgroup_leaf(CGROUP_ROOT, paths[""])
        found = (_read_int(f"{folder}/memory.max") for folder in _up_to(CGROUP_ROOT, leaf))
        limit = min((x for x in found if x is not None), default=None)
        usage = _read_int(f"{leaf}/memory.current")
        inactive = _stat_value(f"{leaf}/memory.stat", "inactive_file")
    else:
        return None
    if limit is None or limit >= _NO_LIMIT:
        return None
    return limit, max(0, (usage or 0) - inactive)


log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


@functools.cache
def tune_host_allocator() -> bool:
    """Keep freed host memory for reuse instead of returning it to the OS at every free (glibc only; once per
    process; `ROLL_MALLOC_TUNING=0` leaves malloc as it is). Returns whether the settings are in effect.

    Why: glibc serves every allocation above 32 MiB with a fresh mmap and unmaps it on free, so each one is
    zero-filled page by page by the kernel when first written. A training step allocates several vocabulary-sized
    tensors per micro-batch (a 135M model's tied embedding gradient is 49152 x 576 fp32 = 113 MB, filled and then
    accumulated): measured 139 ms to zero-fill and 149 ms to add one on a 2-core machine, ~1.2 s of a 7.7 s
    training phase, mostly page faults. With mmap off (M_MMAP_MAX=0) and every thread on the main arena
    (M_ARENA_MAX=1) such blocks come from the heap and are reused; freed memory above 2 GiB at the heap's top is
    still given back (M_TRIM_THRESHOLD). Measured: the same phase 5.5-6.5 s, peak RSS unchanged (4.6 -> 4.7 GB).
    This is what jemalloc/tcmalloc give PyTorch on CPU. Threads that allocated before this call keep their arena.
    """
    if os.environ.get("ROLL_MALLOC_TUNING", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # absent outside glibc (macOS, musl): nothing to tune
    except (OSError, AttributeError):
        return False
    # One arena: a thread's own arena (64 MiB heaps) serves large blocks by mmap whatever M_MMAP_MAX says.
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1))
    ok = all(mallopt(param, value) == 1 for param, value in settings)
    if not ok:
        log.warning("mallopt refused roll's allocator settings: large host tensors are page-faulted at every use")
    return ok


#: Entries oneDNN's primitive cache and ideep's operator cache (PyTorch's oneDNN layer) keep, each (default 1024).
ONEDNN_CACHE_ENTRIES = 32


def bound_onednn_caches() -> dict[str, str]:
    """Cap the two caches oneDNN products fill at `ONEDNN_CACHE_ENTRIES` entries each, through the variables both
    read when the process runs its first oneDNN operation (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`,
    `LRU_CACHE_CAPACITY`); a value already set is kept. Returns the variables set now (empty: nothing changed).
    Engines call it as they start (roll_core.models.prepare_engine_process); after a process's first oneDNN
    operation it changes nothing.

    Why: each entry keeps buffers sized by its shape (measured 0.7 MB at 16 rows to ~10 MB at 3000 rows of a
    SmolLM2 layer), and every training micro-batch's token count and every prefill is a new shape, so the default
    1024 entries grew the quickstart's peak RSS from 4.5 to 6.9 GiB over 12 GRPO steps with oneDNN linears. A
    step's working set is ~20 entries (a shape per layer kind and product; the 30 layers share them): with 32,
    4.8 GiB and 1.15x faster steps (fewer fresh pages)."""
    set_now: dict[str, str] = {}
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        if var not in os.environ:
            os.environ[var] = set_now[var] = str(ONEDNN_CACHE_ENTRIES)
    return set_now


def _cpuinfo(key: str) -> str | None:
    """The value of the first processor's `key` line in /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                # The name before the ':' must be `key` itself (a prefix matched a longer name); a line without
                # ':' (a truncated file, a kernel's or emulator's odd line) is no `key: value` line and is skipped.
                name, colon, value = line.partition(":")
                if colon and name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def _cpu_flags() -> set[str]:
    """The first processor's feature flags from /proc/cpuinfo: x86's `flags` line, or Arm's `Features` (empty
    where there is none)."""
    return set((_cpuinfo("flags") or "").split()) | set((_cpuinfo("Features") or "").split())


def cpu_vendor() -> str:
    """The first processor's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...; "" where unknown)."""
    return _cpuinfo("vendor_id") or ""


def cpu_family() -> int:
    """The first processor's family number from /proc/cpuinfo (AMD Zen 1/2: 23, Zen 3/4: 25, Zen 5: 26; 0 where
    unknown)."""
    value = _cpuinfo("cpu family") or ""
    return int(value) if value.isdigit() else 0


def fp32_linear_library() -> str:
    """Which library roll's CPU engines compute fp32 linear layers with: "onednn" or "mkl" (torch's default).

    `ROLL_CPU_LINEAR=onednn|mkl` decides; unset or `auto`: "onednn" on AMD CPUs with AVX-512, or with AVX2 from
    the Zen family on (cpu family >= 23), else "mkl".
    Why: torch's CPU fp32 matmul is MKL's, and MKL runs its AVX2 kernels on AMD CPUs. Measured on an AMD EPYC
    (Zen 4 family, 2 cores, avx512f): MKL ~210 GFLOP/s at 2048^3, oneDNN ~480 in fp32 (same precision: relative
    error ~1e-6 either way); at a training micro-batch's shapes 1.4-2.1x, at a decode step's 32 rows 1.7x. AMD CPUs
    with AVX2 only (Zen 1-3) were emulated on an AMD EPYC of cpu family 26 (Zen 5) with both libraries held to AVX2
    (`ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2`): oneDNN still won, the
    quickstart rollout 1.45x and the GRPO step 1.09x. On Intel CPUs MKL picks its best kernels itself and stays.
    The choice is read from the CPU, never timed, so a run's numerics do not depend on the machine's load."""
    choice = os.environ.get("ROLL_CPU_LINEAR", "auto").strip().lower() or "auto"
    if choice in ("onednn", "mkl"):
        return choice
    if choice != "auto":
        raise ValueError(f"ROLL_CPU_LINEAR={choice!r}: expected onednn, mkl or auto")
    if cpu_vendor() != "AuthenticAMD":
        return "mkl"
    flags = _cpu_flags()
    # Pre-Zen AMD CPUs with AVX2 (Excavator) are further from the emulated evidence: they keep MKL.
    return "onednn" if "avx512f" in flags or ("avx2" in flags and cpu_family() >= 23) else "mkl"


def cpu_bf16_instructions() -> str | None:
    """Which native bf16 instructions this CPU has: "amx_bf16" (AMX tiles: bf16 training is fast),
    "avx512_bf16" (bf16 dot products: bf16 inference runs natively), "bf16" (Arm's BF16 extension: Graviton 3/4,
    Neoverse V1/V2; its dot products run natively) or None (bf16 is emulated, ~200x slower). An ISA cap set for
    oneDNN (`ONEDNN_MAX_CPU_ISA` / `DNNL_MAX_CPU_ISA`, which runs torch's bf16 matmuls) lowers the answer: a CPU with
    AMX held to AVX2 emulates bf16."""
    flags = _cpu_flags()
    allowed = _isa_cap_allows()
    for kind in ("amx_bf16", "avx512_bf16", "bf16"):
        if kind in flags and kind in allowed:
            return kind
    return None


#: oneDNN ISA caps (lowercase prefixes of ONEDNN_MAX_CPU_ISA's values) and the bf16 instructions each leaves usable.
_ISA_CAPS: tuple[tuple[str, frozenset[str]], ...] = (
    ("avx512_core_amx", frozenset({"amx_bf16", "avx512_bf16"})),
    ("avx10_1_512_amx", frozenset({"amx_bf16", "avx512_bf16"})),
    ("avx10_2_512_amx", frozenset({"amx_bf16", "avx512_bf16"})),  # AVX10_2_512_AMX_2 (alias AVX10_2_AMX_2)
    ("avx10_2_amx", frozenset({"amx_bf16", "avx512_bf16"})),
    ("avx512_core_bf16", frozenset({"avx512_bf16"})),
    ("avx512_core_fp16", frozenset({"avx512_bf16"})),
    ("avx10_1_512", frozenset({"avx512_bf16"})),
)


def _isa_cap_allows() -> frozenset[str]:
    """The native bf16 kinds oneDNN may use under the environment's ISA cap: all of them without a cap (or `ALL`,
    or a value oneDNN does not know), none under a cap below AVX512_CORE_BF16 (SSE41, AVX, AVX2, AVX2_VNNI,
    AVX512_CORE, AVX512_CORE_VNNI), no AMX under AVX10_2 (oneDNN orders it after AVX10_1_512, beside the AMX caps,
    not above them). Arm's BF16 has no such cap."""
    everything = frozenset({"amx_bf16", "avx512_bf16", "bf16"})
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().lower()
    if not cap or cap == "all":
        return everything
    for prefix, kinds in _ISA_CAPS:
        if cap.startswith(prefix):
            return kinds | {"bf16"}
    if cap in ("avx10_2", "avx10_2_512"):  # above AVX10_1_512 but not AVX10_1_512_AMX: no AMX tiles
        return frozenset({"avx512_bf16", "bf16"})
    below = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni")
    return frozenset({"bf16"}) if cap in below else everything


class CpuPlatform(Platform):
    """Plain host CPU. `dtype=auto` is bf16 only with AMX; an explicit bf16 runs where the CPU has native bf16
    instructions (AMX or AVX512-BF16) and becomes fp32 where it would be emulated (~200x slower than fp32)."""

    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    ray_resource: ClassVar[str | None] = None
    visible_devices_env: ClassVar[str | None] = None
    dist_backend: ClassVar[str] = "gloo"
    description: ClassVar[str] = "host CPU"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def memory_stats(cls, index: int = 0) -> MemoryStats:
        """The host's memory, or the memory cgroup's where that is smaller (a container's limit: `cgroup_memory`);
        `allocated` and `reserved` are this process's resident set."""
        info = _meminfo()
        if "MemTotal" in info:
            total = info["MemTotal"]
            free = info.get("MemAvailable", info.get("MemFree", 0))
        else:  # non-Linux fallback
            pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            total, free = pages * page_size, 0
        cgroup = cgroup_memory()
        if cgroup is not None:
            limit, used = cgroup
            total, free = min(total, limit), min(free, max(0, limit - used))
        rss = _rss_bytes()
        return MemoryStats(total=total, free=free, allocated=rss, reserved=rss)

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        name = _pyplatform.processor() or _pyplatform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        usable, cores = usable_cpu_count(), os.cpu_count()
        return f"{name} ({cores} cores)" if usable == cores else f"{name} ({usable} of {cores} cores usable)"

    @classmethod
    def supports_bf16(cls) -> bool:
        # AMX (Sapphire Rapids+) is the only CPU path where bf16 *training* beats fp32: `dtype=auto` picks bf16
        # only there. AVX512-BF16 (Zen 4, Cooper Lake) computes bf16 dot products natively too, so an explicit
        # bf16 request is honoured there (runs_bf16); see bench/RESULTS.md for what it buys.
        return cpu_bf16_instructions() == "amx_bf16"

    @classmethod
    def runs_bf16(cls) -> bool:
        return cpu_bf16_instructions() is not None

    @classmethod
    def describe(cls) -> dict[str, str]:
        out = super().describe()
        try:
            lib = fp32_linear_library()
        except ValueError as exc:  # a bad ROLL_CPU_LINEAR: the doctor says so rather than crash
            lib = f"error ({exc})"
        vendor = cpu_vendor() or "unknown vendor"
        out["fp32 linears (roll engines)"] = f"{lib} ({vendor}; ROLL_CPU_LINEAR overrides)"
        return out

    @classmethod
    def bf16_note(cls) -> str:
        kind = cpu_bf16_instructions()
        return {
            "amx_bf16": "native (AMX tiles)",
            "avx512_bf16": "native dot products (AVX512-BF16, no AMX): honoured when asked, fp32 by default",
            "bf16": "native dot products (Arm BF16): honoured when asked, fp32 by default",
            None: "emulated (no AMX, AVX512-BF16 or Arm BF16, or ONEDNN_MAX_CPU_ISA holds them off: ~200x slower than "
            "fp32): bf16 becomes fp32",
        }[kind]
