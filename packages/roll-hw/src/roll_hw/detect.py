"""Which platform this process runs on.

Every platform, built-in or not, is declared under the entry-point group `roll.platforms` (roll-hw declares cpu,
cuda, rocm and npu in its own pyproject.toml exactly as an out-of-tree plugin declares its own); this module is
the only reader of that group. roll-hw may not import roll-core, so it reads the group itself, in the manner of
`roll_core.registry` (metadata only until a platform is asked for; the result is cached per process).

Resolution order (first match wins):
1. `ROLL_PLATFORM=<name>` forces a platform by name, built-in or plugin; if its probe fails, a
   `PlatformUnavailableError` says why and what to install (never a silent fall-back to CPU).
2. Out-of-tree platforms (entry points of any distribution other than roll-hw) whose probe says available.
   Exactly one may be active: two active plugins are an error. A plugin that takes a built-in's name replaces it;
   two plugins (other distributions) that declare one name with different targets are an error wherever that name
   is loaded (it was whichever sys.path listed last). A plugin named `cpu` is not probed here: it replaces the CPU
   in step 3, so it never wins over an accelerator.
3. roll-hw's own platforms, probed in `PROBE_ORDER` (accelerators first; cpu, always available, last).

`cpu` always resolves, auto-detected or named: a plugin registered as `cpu` (it replaces roll-hw's) that is
unavailable here, or whose probe raises, gives way to roll-hw's own CPU platform with a warning saying why.

roll-hw run from its source folder without being installed (the device checks on a bare machine put `src/` on
PYTHONPATH) has no entry-point metadata: its declarations are then read from the pyproject.toml beside the
source, so the one list stays the pyproject's. A plugin that fails to import is reported with its group, name and
cause rather than being skipped, and so is one whose class's `name` is not the name it is declared under (a Ray
driver hands `platform.name` to its workers, which resolve the platform by it). `auto` is reserved: it means
auto-detection, so a plugin declared under it is an error naming it.
"""

from __future__ import annotations

import logging
import os
import re
from functools import lru_cache
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution, entry_points
from pathlib import Path

from roll_hw.interface import Platform, PlatformUnavailableError

GROUP = "roll.platforms"
ENV_VAR = "ROLL_PLATFORM"
#: What ROLL_PLATFORM / hw.platform say for auto-detection: no platform may be declared under it (`_declared`).
AUTO = "auto"
_BUILTIN_DIST = "roll-hw"

#: The order roll-hw's own platforms are probed in: a CUDA or ROCm build of torch also runs on the CPU, so the
#: CPU, always available, comes last. A roll-hw platform missing here is probed before the CPU.
PROBE_ORDER: tuple[str, ...] = ("cuda", "rocm", "npu", "cpu")


class PlatformPluginError(RuntimeError):
    """A platform entry point failed to load, is not a Platform, or more than one plugin is active."""


def _source_entry_points() -> list[EntryPoint]:
    """roll-hw's `roll.platforms` section read from its pyproject.toml (source checkout, not installed)."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        return []
    # A line reader, not tomllib: Python 3.10 (supported) has no tomllib, and the section is `name = "module:attr"`.
    out, inside = [], False
    for line in pyproject.read_text().splitlines():
        if line.startswith("["):
            inside = line.strip() == f'[project.entry-points."{GROUP}"]'
            continue
        found = re.match(r'\s*([\w.-]+)\s*=\s*"([^"]+)"', line) if inside else None
        if found:
            out.append(EntryPoint(name=found.group(1), value=found.group(2), group=GROUP))
    return out


#: Plugin names declared by more than one distribution (name -> "target from distribution" of each); see `_declared`.
_clashes: dict[str, list[str]] = {}


def _normalized(name: str) -> str:
    """A distribution name as PEP 503 compares it: runs of `-`, `_` and `.` are one `-`, lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value} from {dist.name if dist is not None else 'an unnamed distribution'}"


@lru_cache(maxsize=1)
def _declared() -> tuple[dict[str, EntryPoint], dict[str, EntryPoint]]:
    """(roll-hw's own entry points in probe order, out-of-tree entry points), by name; imports nothing.

    Two out-of-tree distributions declaring one name with different targets are recorded in `_clashes` (the name
    is then an error where used): a dict kept the last one seen, so which platform ran depended on sys.path order.
    A plugin declared as `auto` is a PlatformPluginError: the name means auto-detection wherever a platform is named.
    """
    own: dict[str, EntryPoint] = {}
    plugins: dict[str, EntryPoint] = {}
    _clashes.clear()
    for ep in entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        # Compared as PEP 503 names: a build whose metadata spells it `roll_hw` (or `Roll.HW`) is still roll-hw;
        # compared as written, its built-ins were taken for plugins and roll-hw was left declaring none.
        if dist is not None and _normalized(dist.name) == _BUILTIN_DIST:
            own[ep.name] = ep
            continue
        if ep.name == AUTO:
            raise PlatformPluginError(
                f"platform plugin {GROUP}:{AUTO} ({_origin(ep)}) takes the reserved name {AUTO!r}: {ENV_VAR}={AUTO} "
                f"and hw.platform={AUTO} mean auto-detection, so it could never be chosen by name, and workers told "
                f"its name would detect again; declare it under a name of its own, or uninstall it"
            )
        first = plugins.setdefault(ep.name, ep)
        if first.value != ep.value:
            _clashes.setdefault(ep.name, [_origin(first)]).append(_origin(ep))
    if not own:
        try:
            distribution(_BUILTIN_DIST)
        except PackageNotFoundError:  # running from the source folder
            own = {ep.name: ep for ep in _source_entry_points()}
    if "cpu" not in own:
        raise PlatformUnavailableError(
            f"roll-hw declares no {GROUP} entry points here (not even cpu): reinstall it (pip install roll-hw, "
            "or pip install -e packages/roll-hw in the repository)"
        )
    rank = {name: i for i, name in enumerate(PROBE_ORDER)}
    ordered = sorted(own, key=lambda n: rank.get(n, rank["cpu"] - 0.5))
    return {n: own[n] for n in ordered}, plugins


def _load(ep: EntryPoint) -> type[Platform]:
    where = f"entry point {GROUP}:{ep.name} ({ep.value})"
    try:
        obj = ep.load()
    except Exception as exc:
        raise PlatformPluginError(f"failed to load {where}: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, Platform)):
        raise PlatformPluginError(f"{where} is {obj!r}, not a subclass of roll_hw.Platform")
    if obj.name != ep.name:
        # The class's name is what travels: a Ray driver hands `platform.name` to its workers, which resolve it by
        # name. A plugin declared `acme` whose class kept CudaPlatform's name ran as roll-hw's CUDA in every worker.
        raise PlatformPluginError(
            f"{where} is {obj.__module__}.{obj.__qualname__}, whose name is {obj.name!r}: a platform's `name` must "
            f"be the name it is declared under (workers and {ENV_VAR} resolve it by name); set name = {ep.name!r}"
        )
    return obj


def builtin_names() -> list[str]:
    """roll-hw's own platform names, in probe order. Imports nothing."""
    return list(_declared()[0])


#: Plugins already logged as replacing a built-in ("name = target from distribution"): once per process.
_replacements_logged: set[str] = set()


def _load_plugin(name: str) -> type[Platform]:
    """The out-of-tree platform declared as `name`; an error where two distributions declare that name.

    A plugin that takes a built-in's name is logged (INFO, once per process) naming its distribution and the
    built-in it replaces: run logs otherwise showed only the name, e.g. "cuda", while another package's code ran.
    """
    own, plugins = _declared()
    ep = plugins[name]
    if name in _clashes:
        raise PlatformPluginError(
            f"platform {name!r} is declared by more than one plugin ({'; '.join(_clashes[name])}): uninstall all "
            "but one"
        )
    cls = _load(ep)
    key = f"{name} = {_origin(ep)}"
    if name in own and key not in _replacements_logged:
        _replacements_logged.add(key)
        logging.getLogger(__name__).info(
            "platform %r is the plugin %s, replacing roll-hw's built-in %r (%s)",
            name,
            _origin(ep),
            name,
            own[name].value,
        )
    return cls


@lru_cache(maxsize=1)
def plugin_platforms() -> dict[str, type[Platform]]:
    """Out-of-tree platforms (`roll.platforms` entry points of other distributions), by entry-point name."""
    loaded = {}
    for name in _declared()[1]:
        try:
            loaded[name] = _load_plugin(name)
        except PlatformPluginError as exc:  # only auto-detection loads every plugin: say how to run without them
            raise PlatformPluginError(
                f"{exc}; set {ENV_VAR}=<platform> (or hw.platform) to run without auto-detecting"
            ) from exc.__cause__
    return loaded


def platform_names() -> list[str]:
    """Every known platform name: roll-hw's own first (probe order), then plugins."""
    own, plugins = _declared()
    return list(own) + [n for n in plugins if n not in own]


def get_platform_class(name: str) -> type[Platform]:
    """The platform class registered as `name` (a plugin wins over a built-in of that name); no availability check.
    Only that platform's entry point is loaded: another plugin that fails to import (its vendor SDK missing on this
    node) does not stop a run that names its platform."""
    own, plugins = _declared()
    if name in plugins:
        return _load_plugin(name)
    if name in own:
        return _load(own[name])
    raise PlatformUnavailableError(f"unknown platform {name!r}; installed platforms: {', '.join(platform_names())}")


def resolve_platform(name: str | None = None) -> type[Platform]:
    """Resolve the platform to use: `name` (or `$ROLL_PLATFORM`) if given, else auto-detect.

    Raises:
        PlatformUnavailableError: a forced platform is unknown, unavailable, or its probe raises (each message names
            the platform and, when it came from there, `$ROLL_PLATFORM`).
        PlatformPluginError: a plugin failed to load, or more than one plugin is active.
    """
    from_env = not name
    forced = (name or os.environ.get(ENV_VAR) or "").strip() or None
    if forced and forced != AUTO:
        raw = os.environ.get(ENV_VAR, "")
        source = "requested" if not from_env else f"forced by {ENV_VAR}={raw if raw == forced else repr(raw)}"
        try:
            cls = get_platform_class(forced)
        except PlatformUnavailableError as exc:
            raise PlatformUnavailableError(f"{exc} ({source})") if from_env else exc from None
        if forced == "cpu":
            return _cpu(cls)
        if not _probe(forced, cls, source):
            raise PlatformUnavailableError(f"platform {forced!r} {source} is unavailable: {cls.unavailable_reason()}")
        return cls
    # A plugin named cpu takes roll-hw's CPU's place, last (the built-ins' loop below, through `_cpu`): always
    # available, it was active here and won over a CUDA node's GPUs (or made a second active plugin an error).
    active = [cls for name, cls in plugin_platforms().items() if name != "cpu" and _probe(name, cls)]
    if len(active) > 1:
        names = ", ".join(c.name for c in active)
        raise PlatformPluginError(f"more than one out-of-tree platform is active ({names}); set {ENV_VAR} to choose")
    if active:
        return active[0]
    for builtin in builtin_names():
        cls = get_platform_class(builtin)
        if builtin == "cpu":
            return _cpu(cls)
        if _probe(builtin, cls, "probed"):
            return cls
    raise AssertionError("unreachable: roll-hw declares cpu (checked by _declared), probed last")


def _runs(cls: type[Platform]) -> str | None:
    """None when `cls` is available here, else why not (a probe that raises included, with its exception)."""
    try:
        if cls.is_available():
            return None
        return f"is unavailable ({cls.unavailable_reason()})"
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc} in its probe"


def _cpu(cls: type[Platform]) -> type[Platform]:
    """`cls`, the platform registered as `cpu`, where it runs; else roll-hw's own CPU platform, with a warning: a
    plugin that took the name and is unavailable, or whose probe raises, must not leave a run without its CPU (the
    forced case's advice, "set ROLL_PLATFORM=cpu", would name the very platform that failed)."""
    own = _load(_declared()[0]["cpu"])
    why = None if cls is own else _runs(cls)
    if why is None:
        return cls
    logging.getLogger(__name__).warning(
        "platform plugin 'cpu' (%s.%s) %s: using roll-hw's own cpu platform", cls.__module__, cls.__qualname__, why
    )
    return own


def _probe(name: str, cls: type[Platform], source: str | None = None) -> bool:
    """A platform's `is_available()`; one that raises (a bare driver error) is reported with the platform's name: a
    plugin probed by auto-detection (`source` None) as a PlatformPluginError, a platform forced, requested or probed
    in the built-ins' order (`source` says which) as a PlatformUnavailableError."""
    try:
        return bool(cls.is_available())
    except Exception as exc:
        probe, raised = f"{cls.__module__}.{cls.__qualname__}.is_available", f"{type(exc).__name__}: {exc}"
        if source is None:
            raise PlatformPluginError(
                f"the probe of platform plugin {name!r} ({probe}) raised {raised}; set {ENV_VAR}=<platform> (or "
                "hw.platform) to run without probing it"
            ) from exc
        raise PlatformUnavailableError(
            f"platform {name!r} ({source}): its probe ({probe}) raised {raised}; set {ENV_VAR}=cpu (or "
            "hw.platform=cpu) to run without it"
        ) from exc


def clear_cache() -> None:
    """Forget the declared entry points and loaded plugins (tests that install plugins at run time)."""
    _declared.cache_clear()
    plugin_platforms.cache_clear()
