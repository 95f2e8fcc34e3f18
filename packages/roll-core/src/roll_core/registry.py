"""One plugin loader over roll's entry-point groups.

Entry points say what is installed; config says what a run builds. Every group is `roll.<kind>`:

| group | an entry point loads to | read by |
|---|---|---|
| `roll.platforms` | a `roll_hw.Platform` subclass | `roll_hw.detect` (its own reader: roll-hw cannot import this) |
| `roll.train_engines` / `roll.infer_engines` | an engine class | conformance suites, the unknown-option hint |
| `roll.envs` | a task (single-turn environment) class | the task conformance suite, the unknown-option hint |
| `roll.rewards` | a reward class (`score(responses, answers)`) | the unknown-`_target_` error of `config.build` |
| `roll.agentic_envs` | a multi-turn environment class, named by `env.env=<name>` | `roll_envs.agentic.make_env` |
| `roll.algorithms` | an advantage estimator (callable) | the pipeline (`algo.adv_estimator`), config checks |
| `roll.losses` | a policy loss (`roll_algos.losses.PolicyLoss`), named by `algo.policy_loss` | `roll_algos` (*) |
| `roll.collectors` | a collector factory, named by `pipeline.name` | the CLI |
| `roll.objectives` | an objective factory (the trainer's update), named by a collector's `objective` | the Trainer |
| `roll.trackers` | a metrics sink (`interfaces.tracking.TrackerBackend`), named in `pipeline.trackers` | `Tracker` |
| `roll.configs` | a `register_configs()` that stores dataclass schemas in Hydra's ConfigStore | the CLI, `compose` |

(*) roll-algos may not import roll-core, so it reads `roll.losses` itself, as roll-hw reads `roll.platforms`; config
checks and `roll-doctor` list the group from here.

Built-ins are declared in their package's pyproject.toml exactly as out-of-tree plugins are; `roll-doctor` lists
every group, and tests/plugins/test_entry_points.py loads every entry point and checks it against the config
node that names it.

Contract: listing a group imports nothing (entry-point metadata only); `load` imports one object and caches it;
calling anything twice is cheap and idempotent, because every Ray worker process loads plugins again. An unknown
name raises `PluginNotFoundError` listing what is installed; a failing import raises `PluginLoadError` naming the
group, the name and the cause, and so does a name two distributions declare (which would win depends on install
order: `algo.adv_estimator=grpo` could silently run another package's estimator) and an object of the wrong kind for
its group (`SHAPES`: a tracker entry point naming a function failed at the run's first log with an AttributeError
that named no plugin).
"""

from __future__ import annotations

import difflib
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

GROUPS: tuple[str, ...] = (
    "roll.platforms",
    "roll.train_engines",
    "roll.infer_engines",
    "roll.envs",
    "roll.agentic_envs",
    "roll.rewards",
    "roll.algorithms",
    "roll.losses",
    "roll.collectors",
    "roll.objectives",
    "roll.trackers",
    "roll.configs",
)


#: What each group's entry points must load to: a class with these methods, or any callable (a function or factory).
SHAPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "roll.platforms": ("class", ("is_available", "describe")),
    "roll.train_engines": ("class", ("compute_logprobs", "get_weights")),
    "roll.infer_engines": ("class", ("generate", "shutdown")),
    "roll.envs": ("class", ("train_set", "eval_set", "messages")),
    "roll.agentic_envs": ("class", ("reset", "step")),
    "roll.rewards": ("class", ("score",)),
    "roll.algorithms": ("callable", ()),
    "roll.losses": ("callable", ()),
    "roll.collectors": ("callable", ()),
    "roll.objectives": ("callable", ()),
    "roll.trackers": ("class", ("log", "truncate", "close")),
    "roll.configs": ("callable", ()),
}


class PluginError(LookupError):
    """Base class for registry errors."""


class PluginNotFoundError(PluginError):
    """No plugin of that name is installed in that group."""


class PluginLoadError(PluginError):
    """A plugin is installed but importing it failed."""


def _check_group(group: str) -> None:
    if group not in GROUPS:
        raise PluginNotFoundError(f"unknown plugin group {group!r}; groups are: {', '.join(GROUPS)}")


@cache
def _entry_points(group: str) -> dict[str, EntryPoint]:
    _check_group(group)
    return {ep.name: ep for ep in entry_points(group=group)}


@cache
def _owners(group: str) -> dict[str, list[str]]:
    """name -> the distributions declaring it in `group` (one distribution's entry counted once)."""
    owners: dict[str, list[str]] = {}
    for ep in entry_points(group=group):
        dist = getattr(ep, "dist", None)
        who = dist.name if dist is not None else ep.value
        if who not in owners.setdefault(ep.name, []):
            owners[ep.name].append(who)
    return owners


def available(group: str) -> list[str]:
    """Sorted names installed in `group`. Imports nothing."""
    return sorted(_entry_points(group))


def describe(group: str) -> dict[str, str]:
    """name -> "module:attr (distribution version)" for every plugin in `group`, for error messages and docs."""
    out = {}
    for name, ep in sorted(_entry_points(group).items()):
        dist = getattr(ep, "dist", None)
        out[name] = f"{ep.value} ({dist.name} {dist.version})" if dist is not None else ep.value
    return out


@cache
def load(group: str, name: str) -> Any:
    """Import and return the object registered as `name` in `group`.

    Raises:
        PluginNotFoundError: `name` is not installed; the message lists what is and suggests close names.
        PluginLoadError: the plugin's import failed; the message names group, name, target and cause.
    """
    eps = _entry_points(group)
    if name not in eps:
        installed = ", ".join(sorted(eps)) or "none"
        close = difflib.get_close_matches(name, list(eps), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PluginNotFoundError(f"no plugin {name!r} in group {group!r}; installed: {installed}.{hint}")
    owners = _owners(group).get(name, [])
    if len(owners) > 1:  # which one wins would depend on install order: a silent swap of an estimator or tracker
        raise PluginLoadError(
            f"plugin {name!r} in group {group!r} is declared by {' and '.join(sorted(owners))}: uninstall one, or "
            "rename the plugin's entry point"
        )
    ep = eps[name]
    try:
        obj = ep.load()
    except Exception as exc:
        raise PluginLoadError(
            f"plugin {name!r} in group {group!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    wrong = _wrong_shape(group, obj)
    if wrong:
        raise PluginLoadError(f"plugin {name!r} in group {group!r} ({ep.value}) {wrong}: fix its entry point")
    return obj


def _wrong_shape(group: str, obj: Any) -> str:
    """Why `obj` cannot serve as a plugin of `group` (`SHAPES`), or "" when it can."""
    import inspect

    kind, methods = SHAPES[group]
    if kind == "callable":
        return "" if callable(obj) else f"loads to a {type(obj).__name__}, not a callable"
    if not inspect.isclass(obj):
        return f"loads to a {type(obj).__name__}, not a class (with {', '.join(methods)})"
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    return f"loads to class {obj.__name__}, which lacks {', '.join(missing)}" if missing else ""


def load_all(group: str) -> dict[str, Any]:
    """Load every plugin of `group` (fails on the first broken one, with its name)."""
    return {name: load(group, name) for name in available(group)}


_configs_registered = False


def register_all_configs() -> list[str]:
    """Call every `roll.configs` entry point once per process; returns the names called (empty when already done)."""
    global _configs_registered
    if _configs_registered:
        return []
    import warnings

    # roll_core/conf/hydra/launcher/ray.yaml deliberately extends the Ray launcher's schema of the same name (so that
    # the documented `hydra/launcher=ray` gets roll's defaults); Hydra warns about that pattern on every compose.
    warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema with the same name")
    names = available("roll.configs")
    for name in names:
        load("roll.configs", name)()
    _configs_registered = True
    return names


def clear_cache() -> None:
    """Forget cached entry points and loaded objects (tests that install plugins at run time)."""
    _entry_points.cache_clear()
    _owners.cache_clear()
    load.cache_clear()
