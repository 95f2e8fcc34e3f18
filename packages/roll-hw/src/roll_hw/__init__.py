"""roll-hw: hardware backends for roll (CPU, NVIDIA CUDA, AMD ROCm, Ascend NPU, out-of-tree plugins).

`roll_hw.current_platform` is resolved lazily on first access (module `__getattr__`), so importing roll_hw costs
nothing and never touches a device. Tests may swap it with `set_current_platform`. This package imports no torch
at module level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from roll_hw.detect import (
    ENV_VAR,
    GROUP,
    PlatformPluginError,
    get_platform_class,
    platform_names,
    resolve_platform,
)
from roll_hw.interface import MemoryStats, Platform, PlatformUnavailableError

__version__ = "0.1.0"

__all__ = [
    "ENV_VAR",
    "GROUP",
    "MemoryStats",
    "Platform",
    "PlatformPluginError",
    "PlatformUnavailableError",
    "current_platform",
    "get_platform_class",
    "platform_names",
    "resolve_platform",
    "set_current_platform",
]

_current: type[Platform] | None = None

if TYPE_CHECKING:
    current_platform: type[Platform]


def set_current_platform(platform: type[Platform] | None) -> None:
    """Override (or with None, forget) the resolved platform: for tests and for worker processes."""
    global _current
    _current = platform


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        global _current
        if _current is None:
            _current = resolve_platform()
        return _current
    raise AttributeError(f"module 'roll_hw' has no attribute {name!r}")
