"""`roll-doctor` / `python -m roll_hw`: print what roll sees on this machine, as a table.

Reports the detected platform, every known platform's probe, devices, torch version, which torch.distributed
backends are compiled in, which optional engines are installed and their versions (from the package metadata, not
imported: Megatron-Core alone takes seconds and warns about Transformer Engine on import), every installed roll
plugin (train and inference engines, environments, rewards, estimators, policy losses, collectors, trackers,
platforms: entry-point names only, nothing imported), and each tracker backend with whether its package is
installed (its module is imported for its `extra` attribute; the service's package is not). It never fails on a
missing optional package: every probe is wrapped, and the worst outcome is a row that says "no (<reason>)".
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable

from roll_hw.detect import _BUILTIN_DIST, GROUP, _normalized, get_platform_class, platform_names, resolve_platform

#: Optional engines and libraries: display name -> import name.
OPTIONAL_ENGINES: dict[str, str] = {
    "transformers": "transformers",
    "ray": "ray",
    "vllm": "vllm",
    "sglang": "sglang",
    "megatron-core": "megatron.core",
    "flash-attn": "flash_attn",
    "torch_npu": "torch_npu",
    "deepspeed": "deepspeed",
}


def _version_of(module_name: str, dist: str | None = None) -> str:
    """The version of an installed module, or "no (reason)". With `dist` (its distribution's name) the version is
    read from the package metadata and the module is not imported; without metadata (a source checkout) or
    `dist`, the module is imported and asked."""
    try:
        if importlib.util.find_spec(module_name.split(".")[0]) is None:
            return "no (not installed)"
        if dist is not None:
            from importlib.metadata import PackageNotFoundError, version

            try:
                return version(dist)
            except PackageNotFoundError:
                pass
        mod = importlib.import_module(module_name)
    except Exception as exc:  # a broken optional install must not crash the doctor
        return f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''})"
    top = sys.modules.get(module_name.split(".")[0], mod)
    return str(getattr(mod, "__version__", getattr(top, "__version__", "yes")))


def _dist_backends() -> str:
    try:
        import torch.distributed as dist
    except Exception as exc:
        return f"none ({exc})"
    if not dist.is_available():
        return "none (torch built without distributed)"
    names = []
    for backend, probe in (("gloo", "is_gloo_available"), ("nccl", "is_nccl_available"), ("mpi", "is_mpi_available")):
        if getattr(dist, probe, lambda: False)():
            names.append(backend)
    if importlib.util.find_spec("torch_npu") is not None:
        from roll_hw.npu import NpuPlatform

        # Installed is not importable: a broken CANN toolkit makes torch_npu raise at import.
        names.append("hccl (torch_npu)" if NpuPlatform._torch_npu() is not None else "hccl (torch_npu broken)")
    return ", ".join(names) or "none"


#: Plugin kinds roll reads (entry-point groups), listed by name without importing anything.
PLUGIN_GROUPS: dict[str, str] = {
    "train engines": "roll.train_engines",
    "inference engines": "roll.infer_engines",
    "environments / tasks": "roll.envs",
    "agentic environments": "roll.agentic_envs",
    "rewards": "roll.rewards",
    "advantage estimators": "roll.algorithms",
    "policy losses": "roll.losses",
    "collectors (pipelines)": "roll.collectors",
    "objectives (updates)": "roll.objectives",
    "trackers (metrics sinks)": "roll.trackers",
    "platforms": "roll.platforms",
}


def _plugins(group: str) -> str:
    """`name (distribution)` for every entry point of `group`, sorted by name. A name several distributions declare
    shows them all: a platform plugin that replaces roll-hw's (detect: the plugin wins) as `cuda (acme; replaces
    roll-hw's)`, any other such name as a clash (an error where it is loaded). Keeping one per name showed whichever
    distribution came last on sys.path: `cuda (roll-hw)` while a plugin's class ran."""
    from importlib.metadata import entry_points

    found: dict[str, list[str]] = {}
    for ep in entry_points(group=group):
        dist = getattr(ep, "dist", None)
        owners = found.setdefault(ep.name, [])
        if dist is not None and dist.name not in owners:
            owners.append(dist.name)
    out = []
    for name in sorted(found):
        owners = sorted(found[name])
        # PEP 503 names, as detect compares them: roll-hw's metadata spelled `roll_hw` is still roll-hw (a plugin
        # replacing its cuda showed as a CLASH, which detect does not raise).
        others = [d for d in owners if _normalized(d) != _BUILTIN_DIST]
        if len(owners) < 2:
            out.append(f"{name} ({owners[0]})" if owners else name)
        elif group == GROUP and len(others) == 1:
            out.append(f"{name} ({others[0]}; replaces {_BUILTIN_DIST}'s)")
        else:
            out.append(f"{name} (CLASH: declared by {' and '.join(owners)})")
    return ", ".join(out) or "none installed"


def tracker_rows() -> list[tuple[str, str]]:
    """One row per `roll.trackers` backend: "ready (<package> <version>)", "ready" (nothing to install), or
    "no: pip install '<extra>'". Reads the backend class's `extra` attribute (roll_core.interfaces.tracking); the
    service's package itself is found, not imported."""
    from importlib.metadata import PackageNotFoundError, entry_points, version

    rows = []
    for ep in sorted(entry_points(group="roll.trackers"), key=lambda e: e.name):
        try:
            extra = getattr(ep.load(), "extra", None)
            if extra is None:
                status = "ready"
            elif not extra.installed():
                status = f"no: pip install '{extra.extra}'"
            else:
                try:
                    status = f"ready ({extra.dist} {version(extra.dist)})"
                except PackageNotFoundError:  # importable without distribution metadata (a source checkout)
                    status = f"ready ({extra.dist})"
        except Exception as exc:  # a broken plugin must not crash the doctor
            status = f"error ({type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''})"
        rows.append((ep.name, status))
    return rows or [("(none)", "no roll.trackers installed")]


def table(rows: Iterable[tuple[str, str]], title: str) -> str:
    """Format (key, value) rows as a two-column text table under a title."""
    rows = list(rows)
    width = max((len(k) for k, _ in rows), default=0)
    line = "-" * (width + 3 + max((len(v) for _, v in rows), default=0))
    out = [title, line]
    out += [f"{k.ljust(width)} | {v}" for k, v in rows]
    out.append(line)
    return "\n".join(out)


def report() -> tuple[str, bool]:
    """The whole doctor report as text, and whether the platform resolved."""
    sections = []
    try:
        current = resolve_platform()
        detected = current.name
    except Exception as exc:
        current, detected = None, f"ERROR: {exc}"
    rows = [("detected platform", detected), ("python", sys.version.split()[0]), ("torch", _version_of("torch"))]
    rows.append(("torch.distributed backends", _dist_backends()))
    sections.append(table(rows, "roll-doctor"))
    if current is not None:
        try:  # a platform that probes available may still fail here (a driver older than torch's CUDA)
            described = list(current.describe().items())
        except Exception as exc:
            described = [("error", f"{type(exc).__name__}: {exc}")]
        sections.append(table(described, f"platform: {current.name}"))
    probes = []
    try:
        names = platform_names()
    except Exception as exc:  # no roll.platforms metadata (a copied roll_hw, a stale install): still report
        names, probes = [], [("(platforms)", f"error ({exc})")]
    for name in names:
        try:
            cls = get_platform_class(name)
            probes.append((name, "available" if cls.is_available() else f"no ({cls.unavailable_reason()})"))
        except Exception as exc:
            probes.append((name, f"error ({exc})"))
    sections.append(table(probes, "platform probes"))
    # Display names are the distributions' names (torch_npu's is torch-npu).
    engines = [(k, _version_of(v, k.replace("_", "-"))) for k, v in OPTIONAL_ENGINES.items()]
    sections.append(table(engines, "optional engines"))
    sections.append(table([(k, _plugins(g)) for k, g in PLUGIN_GROUPS.items()], "installed roll plugins"))
    sections.append(table(tracker_rows(), "trackers (pipeline.trackers=[...])"))
    return "\n\n".join(sections), current is not None


def main(argv: list[str] | None = None) -> int:
    """Console entry point: print the report; exit 1 if the platform could not be resolved (2: a bad option)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="roll-doctor",
        description="What roll sees on this machine: the platform it would pick (ROLL_PLATFORM to force one), "
        "devices, bf16 support, optional engines, installed plugins and trackers. Takes no options.",
    )
    parser.parse_args(argv)  # --help answers; an unknown option exits 2 instead of passing silently
    text, ok = report()
    print(text)
    return 0 if ok else 1
