"""Environments by name: `make_env("sokoban", width=8)`, `make_env("gem:game:Sudoku-v0-easy")`, `make_env("gym:<id>")`.

Names are the `roll.agentic_envs` entry points of every installed package, read through `roll_core.registry`:
roll-envs declares its own (sokoban, frozen_lake, guess_number, tool_math) in its pyproject.toml exactly as an
out-of-tree package declares its environments, so there is no second list here; keyword arguments go to the
class's constructor. Prefixes adapt whole outside libraries, so they are not entry points: `gem:<id>` builds
`GemEnv(<id>, **kwargs)` (needs gem-llm), `gym:<id>` builds `GymTextEnv(<id>, **kwargs)` (needs gymnasium),
`skyrl:<id>` builds `SkyRLEnv(<id>, rows=... or data_file=...)` (needs skyrl-gym); the id is everything after the
first colon. An unknown name is a ValueError listing what exists. Imports are lazy: naming one environment loads
only its module.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

GROUP = "roll.agentic_envs"
#: Adapter prefixes (`<prefix>:<id>`) and their classes (module:Class under roll_envs.agentic).
PREFIXES = {"gem": "gem_adapter:GemEnv", "gym": "gem_adapter:GymTextEnv", "skyrl": "skyrl_adapter:SkyRLEnv"}


def _load_adapter(target: str) -> Any:
    module, cls = target.split(":")
    return getattr(importlib.import_module(f"roll_envs.agentic.{module}"), cls)


def _installed() -> list[str]:
    from roll_core.registry import available

    return available(GROUP)


def available_envs() -> list[str]:
    """Installed environment names (`roll.agentic_envs`, roll-envs' own included) and the accepted prefixes."""
    return [*_installed(), *(f"{p}:<id>" for p in PREFIXES)]


def make_env(name: str, **kwargs: Any) -> Any:
    """A new environment instance for `name` (see the module docstring).

    Raises:
        ValueError: `name` is neither installed nor `<prefix>:<id>`; the message lists what is.
        roll_core.registry.PluginLoadError: the environment's module failed to import (names the cause).
    """
    return env_factory(name)(**kwargs)


def env_factory(name: str) -> Callable[..., Any]:
    """What `make_env(name, **kwargs)` calls with the keyword arguments: the environment's class, or an adapter's
    class with the id bound (`functools.partial`), so that its signature lists the keywords it takes. Raises as
    `make_env` does."""
    if name in _installed():
        from roll_core.registry import load

        return load(GROUP, name)
    prefix, sep, env_id = name.partition(":")
    if sep and prefix in PREFIXES:
        if not env_id:
            raise ValueError(f"env {name!r}: write {prefix}:<id>")
        return functools.partial(_load_adapter(PREFIXES[prefix]), env_id)
    import difflib

    close = difflib.get_close_matches(name, _installed(), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown environment {name!r}; available: {', '.join(available_envs())}.{hint}")
