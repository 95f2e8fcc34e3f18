"""Environments by name: `make_env("sokoban", width=8)`, `make_env("gem:game:Sudoku-v0-easy")`, `make_env("gym:<id>")`.

Built-ins: sokoban, frozen_lake, guess_number, tool_math (keyword arguments go to their constructors); other
installed packages add environments through the `roll.agentic_envs` entry-point group (name = class). Prefixes:
`gem:<id>` builds `GemEnv(<id>, **kwargs)` (needs gem-llm), `gym:<id>` builds `GymTextEnv(<id>, **kwargs)` (needs
gymnasium), `skyrl:<id>` builds `SkyRLEnv(<id>, rows=... or data_file=...)` (needs skyrl-gym); the id is everything
after the first colon. An unknown name is a ValueError listing what exists.
Imports are lazy: naming one environment loads only its module.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Built-in environment names and their classes (module:Class under roll_envs.agentic).
BUILTIN_ENVS: dict[str, str] = {
    "sokoban": "sokoban:SokobanEnv",
    "frozen_lake": "frozen_lake:FrozenLakeEnv",
    "guess_number": "guess_number:GuessNumberEnv",
    "tool_math": "tool_env:ToolMathEnv",
}
PREFIXES = {"gem": "gem_adapter:GemEnv", "gym": "gem_adapter:GymTextEnv", "skyrl": "skyrl_adapter:SkyRLEnv"}


def _load(target: str) -> Any:
    module, cls = target.split(":")
    return getattr(importlib.import_module(f"roll_envs.agentic.{module}"), cls)


def _plugins() -> list[str]:
    from roll_core.registry import available

    return [n for n in available("roll.agentic_envs") if n not in BUILTIN_ENVS]


def available_envs() -> list[str]:
    """Built-in names, installed plugins (`roll.agentic_envs`) and the accepted prefixes."""
    return [*BUILTIN_ENVS, *_plugins(), *(f"{p}:<id>" for p in PREFIXES)]


def make_env(name: str, **kwargs: Any) -> Any:
    """A new environment instance for `name` (see the module docstring)."""
    if name in BUILTIN_ENVS:
        return _load(BUILTIN_ENVS[name])(**kwargs)
    if name in _plugins():
        from roll_core.registry import load

        return load("roll.agentic_envs", name)(**kwargs)
    prefix, sep, env_id = name.partition(":")
    if sep and prefix in PREFIXES:
        if not env_id:
            raise ValueError(f"env {name!r}: write {prefix}:<id>")
        return _load(PREFIXES[prefix])(env_id, **kwargs)
    raise ValueError(f"unknown environment {name!r}; available: {', '.join(available_envs())}")
