"""The CPU platform: always available, gloo collectives, host memory from /proc (no psutil needed)."""

from __future__ import annotations

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


class CpuPlatform(Platform):
    """Plain host CPU. bf16 is reported unsupported because on CPUs without AMX it is ~200x slower than fp32."""

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
        info = _meminfo()
        if "MemTotal" in info:
            total = info["MemTotal"]
            free = info.get("MemAvailable", info.get("MemFree", 0))
        else:  # non-Linux fallback
            pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            total, free = pages * page_size, 0
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
        return f"{name} ({os.cpu_count()} cores)"

    @classmethod
    def supports_bf16(cls) -> bool:
        # AMX (Sapphire Rapids+) is the only CPU path where bf16 training beats fp32.
        try:
            with open("/proc/cpuinfo") as f:
                return "amx_bf16" in f.read()
        except OSError:
            return False
