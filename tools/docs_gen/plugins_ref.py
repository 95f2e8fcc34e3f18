"""The plugins reference: every entry-point group of roll_core.registry and the names roll's packages register.

Contract: `plugins_page()` returns the page's markdown. The groups are `roll_core.registry.GROUPS`; what each one
loads to and who reads it comes from the table in the registry's module docstring (one source for both); the
names are read from the installed distributions' entry-point metadata (nothing is imported). Only roll's own five
distributions are listed by default: an out-of-tree plugin installed in the building environment (the tests'
dummy ones) is not part of roll, and `roll-doctor` lists what a given environment has.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib.metadata import entry_points

from docs_gen.markdown import cell, code, table

ROLL_DISTRIBUTIONS = ("roll-hw", "roll-algos", "roll-core", "roll-engines", "roll-envs")


def _dist_name(ep) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "?"


def is_roll_distribution(name: str) -> bool:
    return name.replace("_", "-").lower() in ROLL_DISTRIBUTIONS


def group_descriptions() -> dict[str, tuple[str, str]]:
    """group -> (what an entry point loads to, who reads it), from the registry's docstring table."""
    from roll_core import registry

    out = {}
    for line in (registry.__doc__ or "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`roll."):
            for group in re.findall(r"`(roll\.[a-z_]+)`", cells[0]):
                out[group] = (cells[1], cells[2])
    return out


def plugins_page(include: Callable[[str], bool] = is_roll_distribution) -> str:
    """The page (see the module docstring)."""
    from roll_core import registry

    described = group_descriptions()
    lines = ["# Plugins", ""]
    lines.append(
        "roll finds its parts through Python entry points: a built-in engine, environment, reward, algorithm or "
        "tracker is declared in its package's `pyproject.toml` exactly as an out-of-tree plugin declares its own. "
        "This page lists each group and what roll's packages register in it (generated from the installed "
        "packages' metadata). `roll-doctor` lists what your environment has, plugins included.\n"
    )
    rows = []
    for group in registry.GROUPS:
        # A group the registry's table leaves out says so (the table is the one place that describes groups).
        loads, reader = described.get(group, ("not described in `roll_core.registry`'s table", ""))
        rows.append([f"[`{group}`](#{group.replace('.', '')})", cell(loads), cell(reader) or "&nbsp;"])
    lines.append(table(["Group", "An entry point loads to", "Read by"], rows))
    for group in registry.GROUPS:
        lines += [f"## `{group}` {{ #{group.replace('.', '')} }}", ""]
        eps = sorted(entry_points(group=group), key=lambda ep: ep.name)
        ours = [ep for ep in eps if include(_dist_name(ep))]
        if not ours:
            lines.append("roll's packages register nothing here; plugins may.\n")
            continue
        rows = [[code(ep.name), code(ep.value), f"`{_dist_name(ep)}`"] for ep in ours]
        lines.append(table(["Name", "Object", "Package"], rows))
    return "\n".join(lines)
