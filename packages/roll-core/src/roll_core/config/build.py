"""Build objects from `_target_` configs (dataclass or dict), adding run-time keyword arguments.

The config's own keys are what a user writes; run-time arguments (model path, learning rate, seed) come from
other parts of the run config and are merged in here. Nested `_target_` nodes (an env's `reward`) are built
recursively by Hydra's instantiate.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def as_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict of a dataclass or mapping config (nested dataclasses included)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if hasattr(cfg, "items"):
        from omegaconf import DictConfig, OmegaConf

        return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    raise TypeError(f"expected a dataclass or mapping config, got {type(cfg).__name__}")


def build(cfg: Any, **runtime: Any) -> Any:
    """Instantiate `cfg["_target_"]` with the config's keys plus `runtime` (runtime wins on a clash)."""
    from hydra.utils import instantiate

    node = as_dict(cfg)
    if "_target_" not in node:
        raise ValueError(f"config has no _target_: {sorted(node)}")
    node.update(runtime)
    from hydra.errors import InstantiationException

    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as exc:
        # Hydra reports the top-level constructor's own error (a missing data file, a bad row) as its repr inside
        # "Error in call to target ...": re-raise the original, whose type and message are what the user acts on.
        # A nested node's error keeps Hydra's wrapper, which names the node (full_key: reward).
        cause = exc.__cause__
        if str(exc).startswith("Error in call to target") and "full_key:" not in str(exc) and cause is not None:
            raise cause from cause.__cause__  # hides the wrapper, keeps the original's own cause chain
        hint = _installed_hint(str(exc))
        if hint:
            raise InstantiationException(f"{exc}\n{hint}") from exc
        raise


#: Nested `_target_` nodes whose implementations are plugins: node key -> entry-point group.
NESTED_PLUGIN_GROUPS = {"reward": "roll.rewards"}


def _installed_hint(message: str) -> str:
    """For a nested `_target_` that cannot be found (`env.reward._target_=my.Rewrd`): the installed ones."""
    import re

    found = re.search(r"Error locating target '([^']*)'.*full_key: (\w+)", message, re.S)
    if not found or found.group(2) not in NESTED_PLUGIN_GROUPS:
        return ""
    from roll_core import registry

    group = NESTED_PLUGIN_GROUPS[found.group(2)]
    installed = {name: ep.replace(":", ".", 1) for name, ep in registry.describe(group).items()}
    rows = [f"\t{name}: {target}" for name, target in installed.items()] or ["\tnone"]
    return "\n".join([f"Installed {found.group(2)} classes ({group} entry points), as _target_:", *rows])
