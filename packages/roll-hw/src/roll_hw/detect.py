"""Which platform this process runs on.

Resolution order (first match wins):
1. `ROLL_PLATFORM=<name>` forces a platform by name, built-in or plugin; if its probe fails, a
   `PlatformUnavailableError` says why and what to install (never a silent fall-back to CPU).
2. Out-of-tree platforms registered under the entry-point group `roll.platforms` by any distribution other
   than roll-hw whose probe says available. Exactly one may be active: two active plugins are an error.
3. Built-ins probed in order: cuda, rocm, npu, then cpu (always available).

Entry points are read with `importlib.metadata` (no pkg_resources); a plugin that fails to import is reported
with its group, name and cause rather than being skipped.
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import import_module
from importlib.metadata import entry_points

from roll_hw.interface import Platform, PlatformUnavailableError

GROUP = "roll.platforms"
ENV_VAR = "ROLL_PLATFORM"
_BUILTIN_DIST = "roll-hw"

#: Built-in platforms by name, as import paths so that listing them imports nothing heavy.
BUILTINS: dict[str, str] = {
    "cuda": "roll_hw.cuda:CudaPlatform",
    "rocm": "roll_hw.rocm:RocmPlatform",
    "npu": "roll_hw.npu:NpuPlatform",
    "cpu": "roll_hw.cpu:CpuPlatform",
}


class PlatformPluginError(RuntimeError):
    """An out-of-tree platform failed to load or is ambiguous."""


def _load_path(path: str) -> type[Platform]:
    module, _, attr = path.partition(":")
    return getattr(import_module(module), attr)


def _check_platform_class(obj: object, where: str) -> type[Platform]:
    if not (isinstance(obj, type) and issubclass(obj, Platform)):
        raise PlatformPluginError(f"{where} is {obj!r}, not a subclass of roll_hw.Platform")
    return obj


@lru_cache(maxsize=1)
def plugin_platforms() -> dict[str, type[Platform]]:
    """Out-of-tree platforms from the `roll.platforms` entry-point group, by entry-point name."""
    found: dict[str, type[Platform]] = {}
    for ep in entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        if dist is not None and dist.name == _BUILTIN_DIST:
            continue
        where = f"entry point {GROUP}:{ep.name} ({ep.value})"
        try:
            obj = ep.load()
        except Exception as exc:
            raise PlatformPluginError(f"failed to load {where}: {type(exc).__name__}: {exc}") from exc
        found[ep.name] = _check_platform_class(obj, where)
    return found


def platform_names() -> list[str]:
    """Every known platform name: built-ins first, then plugins."""
    return list(BUILTINS) + [n for n in plugin_platforms() if n not in BUILTINS]


def get_platform_class(name: str) -> type[Platform]:
    """The platform class registered as `name` (built-in or plugin); no availability check."""
    plugins = plugin_platforms()
    if name in plugins:
        return plugins[name]
    if name in BUILTINS:
        return _load_path(BUILTINS[name])
    raise PlatformUnavailableError(f"unknown platform {name!r}; installed platforms: {', '.join(platform_names())}")


def resolve_platform(name: str | None = None) -> type[Platform]:
    """Resolve the platform to use: `name` (or `$ROLL_PLATFORM`) if given, else auto-detect.

    Raises:
        PlatformUnavailableError: a forced platform is unknown or its probe fails.
        PlatformPluginError: a plugin failed to load, or more than one plugin is active.
    """
    forced = name or os.environ.get(ENV_VAR) or None
    if forced and forced != "auto":
        cls = get_platform_class(forced)
        if not cls.is_available():
            source = "requested" if name else f"forced by {ENV_VAR}={forced}"
            raise PlatformUnavailableError(f"platform {forced!r} {source} is unavailable: {cls.unavailable_reason()}")
        return cls
    active = [cls for cls in plugin_platforms().values() if cls.is_available()]
    if len(active) > 1:
        names = ", ".join(c.name for c in active)
        raise PlatformPluginError(f"more than one out-of-tree platform is active ({names}); set {ENV_VAR} to choose")
    if active:
        return active[0]
    for path in BUILTINS.values():
        cls = _load_path(path)
        if cls.is_available():
            return cls
    raise AssertionError("unreachable: the cpu platform is always available")
