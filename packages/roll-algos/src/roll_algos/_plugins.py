"""roll-algos' reader of the `roll.losses` entry-point group (private; `roll_algos.losses` is its only user).

Every policy loss, built-in or out-of-tree, is declared under `[project.entry-points."roll.losses"]`: roll-algos
declares its own (ppo, gspo, ...) in its pyproject.toml exactly as a plugin package declares its. roll-algos may
import nothing of roll-core, so it reads the group itself, in the manner of `roll_hw.detect` for `roll.platforms`:
metadata only until a loss is asked for, cached per process (every Ray worker reads it again, cheaply).

roll-algos run from its source folder without being installed (the device checks put `src/` on PYTHONPATH), or an
editable install made before the group existed, has no `roll.losses` metadata of its own: its declarations are then
read from the pyproject.toml beside the source, so the one list stays the pyproject's. A name declared by two
distributions is refused when asked for (a plugin never silently replaces `ppo`); an entry point that fails to
import is reported with its group, name, target and cause.
"""

from __future__ import annotations

import re
from functools import cache, lru_cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import NamedTuple

GROUP = "roll.losses"
_OWN_DIST = "roll-algos"


class PolicyLossPluginError(RuntimeError):
    """A `roll.losses` entry point failed to load, is not callable, or its name is declared twice."""


def _normalise(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def _source_entry_points() -> list[EntryPoint]:
    """roll-algos' `roll.losses` section read from its pyproject.toml (source checkout, not installed)."""
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


class Declared(NamedTuple):
    """What the installed distributions declare under `roll.losses`."""

    #: name -> entry point: roll-algos' own first, then plugins', each part sorted by name (installed metadata is
    #: sorted, so the source fallback sorts too: one order either way).
    entry_points: dict[str, EntryPoint]
    #: roll-algos' own names, sorted.
    own: tuple[str, ...]
    #: name -> the distributions that declare it, for names declared more than once.
    clashes: dict[str, list[str]]


@lru_cache(maxsize=1)
def declared() -> Declared:
    """The declared `roll.losses` entry points (metadata only: imports nothing)."""
    own: dict[str, EntryPoint] = {}
    plugins: dict[str, EntryPoint] = {}
    owners: dict[str, list[str]] = {}
    for ep in entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        dist_name = _normalise(dist.name) if dist is not None else "?"
        owners.setdefault(ep.name, []).append(dist_name)
        (own if dist_name == _OWN_DIST else plugins)[ep.name] = ep
    if not own:  # source checkout, or metadata older than the group: the pyproject beside the source is the list
        own = {ep.name: ep for ep in _source_entry_points()}
        for name in own:
            owners.setdefault(name, []).append(_OWN_DIST)
    if not own:
        raise PolicyLossPluginError(
            f"roll-algos declares no {GROUP} entry points here (not even ppo): reinstall it (pip install roll-algos, "
            "or pip install -e packages/roll-algos in the repository)"
        )
    merged = {n: own[n] for n in sorted(own)}
    merged.update({n: plugins[n] for n in sorted(plugins) if n not in own})
    clashes = {n: sorted(d, key=lambda x: (x != _OWN_DIST, x)) for n, d in owners.items() if len(d) > 1}
    return Declared(merged, tuple(sorted(own)), clashes)


def names() -> tuple[str, ...]:
    """Every declared policy-loss name: roll-algos' own first, then plugins', each part sorted."""
    return tuple(declared().entry_points)


@cache
def load(name: str) -> object:
    """Import the object declared as `name`; KeyError if no distribution declares it.

    Raises:
        PolicyLossPluginError: the name is declared twice, or its import failed, or it is not callable.
    """
    eps, _, clashes = declared()
    ep = eps[name]
    where = f"entry point {GROUP}:{name} ({ep.value})"
    if name in clashes:
        raise PolicyLossPluginError(
            f"{where} is declared by {' and '.join(clashes[name])}: rename the plugin's entry point"
        )
    try:
        obj = ep.load()
    except Exception as exc:
        raise PolicyLossPluginError(f"failed to load {where}: {type(exc).__name__}: {exc}") from exc
    if not callable(obj):
        raise PolicyLossPluginError(f"{where} is {obj!r}, not a callable PolicyLoss")
    return obj


def clear_cache() -> None:
    """Forget the declared entry points and loaded losses (tests that install a plugin at run time)."""
    declared.cache_clear()
    load.cache_clear()
