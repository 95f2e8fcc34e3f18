"""Compose, validate and materialise run configs; turn Hydra/OmegaConf errors into actionable messages.

- `compose(overrides)` composes a primary config (Hydra compose API) without building anything, over the config
  groups the installed packages ship and the user's conf folder layered on top (roll_core.config.search_path).
- `find_conf_dir()` is the folder searched first: the user's conf folder, else roll-core's packaged configs.
- `to_object(cfg)` turns the DictConfig into dataclasses once, at the entry point, running every `__post_init__`.
- `explain(exc)` walks an exception chain for the OmegaConf error that names a key and adds "did you mean".
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from roll_core.config.search_path import (
    PRIMARY_PACKAGE,
    check_package_conflicts,
    group_options,
    package_dir,
    primary_config_path,
    user_conf_dir,
)
from roll_core.errors import ConfigError, exception_chain

__all__ = ["ConfigError", "compose", "explain", "find_conf_dir", "load_config", "to_object"]


def find_conf_dir() -> Path:
    """The config folder Hydra searches first: the user's (`search_path.user_conf_dir()`), else roll-core's own.

    Raises:
        ConfigError: `$ROLL_CONF_DIR` is not a folder, or roll-core's packaged configs are missing (a broken install).
    """
    user = user_conf_dir()
    if user is not None:
        return user
    packaged = package_dir(PRIMARY_PACKAGE)
    if packaged is None:
        raise ConfigError(f"roll-core's packaged configs ({PRIMARY_PACKAGE}) are missing: reinstall roll-core")
    return packaged


def _dataclass_fields(obj_type: Any) -> list[str]:
    if obj_type is not None and is_dataclass(obj_type):
        return [f.name for f in fields(obj_type) if not f.name.startswith("_")]
    return []


def did_you_mean(key: str, candidates: Sequence[str], full_key: str) -> str:
    """ "Did you mean 'parent.closest'?" for the closest candidate to `key`, or "" when none is close."""
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    if not close:
        return ""
    parent = full_key.rsplit(".", 1)[0] + "." if "." in full_key else ""
    return f"Did you mean '{parent}{close[0]}'?"


def explain(exc: BaseException) -> str:
    """A one-paragraph message for a composition error, with a "did you mean" when a close key exists."""
    from omegaconf.errors import OmegaConfBaseException

    chain = exception_chain(exc)
    # An exception raised with None as its message (antlr's NoViableAltException under Hydra's override parser
    # error) reads "None": a stray last line of the message.
    lines = [line for e in chain if e.args != (None,) for line in str(e).strip().splitlines()]
    # Hydra suggests "+key=value" for unknown keys, which a structured config rejects too; OmegaConf repeats
    # its message as an unformatted template. Neither helps a user.
    lines = [ln for ln in lines if ln.strip() and not ln.startswith("To append to your config") and "$VALUE" not in ln]
    # Hydra lists each group's schema (algo_schema: the node every option's YAML extends) among its options.
    lines = [ln for ln in lines if not _SCHEMA_OPTION.fullmatch(ln)]
    message = "\n".join(dict.fromkeys(lines))
    plugins = _installed_plugins_hint(message)
    message += plugins if "Did you mean" in plugins else plugins + _option_hint(message)
    for err in chain:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "key", None) is not None:
            key = str(err.key)
            full_key = getattr(err, "full_key", None) or key
            if getattr(err, "object_type", None) is dict and "." in full_key and "Could not override" in message:
                # A map whose keys the user chooses (cluster.call_timeouts, model.chat_template_kwargs): Hydra adds a
                # new key only with `+`, and `map={k: v}` merges into it the same way; OmegaConf says "not in struct".
                message += f"\n{full_key.rsplit('.', 1)[0]} is a map: add the key '{key}' with +{full_key}=<value>"
                break
            candidates = _dataclass_fields(getattr(err, "object_type", None))
            # An existing key means the value is what is wrong, and the message already says why.
            if key not in candidates:
                hint = did_you_mean(key, candidates, getattr(err, "full_key", None) or key)
                message += f"\n{hint}" if hint else ""
                if not hint and candidates:
                    message += f"\nValid keys here: {', '.join(candidates)}"
            break
    return message


#: An unknown option (`algo=grpoo`, `env/reward=mth`: nested groups keep their slashes) in Hydra's message.
_NOT_FOUND = re.compile(r"Could not find '([\w/.-]+)/([\w.-]+)'")
#: A schema in Hydra's list of a group's options (a tab, then `<name>_schema`).
_SCHEMA_OPTION = re.compile(r"\t[\w.-]+_schema")


def _option_hint(message: str) -> str:
    """ "Did you mean 'group=closest'?" for an unknown option, among the options Hydra's message lists."""
    found = _NOT_FOUND.search(message)
    if not found:
        return ""
    group, name = found.groups()
    listed, options = False, []
    for line in message.splitlines():
        if line.startswith("Available options in"):
            listed = line == f"Available options in '{group}':"
        elif listed and line.startswith("\t"):
            options.append(line.strip())
        else:
            listed = False
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f"\nDid you mean '{group}={close[0]}'?" if close else ""


#: Config groups whose options are plugins, and the entry-point group that says what is installed.
PLUGIN_GROUPS = {"infer_engine": "roll.infer_engines", "train_engine": "roll.train_engines", "env": "roll.envs"}
#: The package that ships each plugin group's YAML, and what to install for the default option.
GROUP_PACKAGES = {
    "infer_engine": ("roll_engines", "roll-engines[hf]"),
    "train_engine": ("roll_engines", "roll-engines[hf]"),
    "env": ("roll_envs", "roll-envs[math]"),
}


def _installed_plugins_hint(message: str) -> str:
    """For an unknown `infer_engine=x` (or train_engine, env): what is installed, and the closest name."""
    from roll_core import registry

    found = _NOT_FOUND.search(message)
    if not found or found.group(1) not in PLUGIN_GROUPS:
        return ""
    group, name = found.groups()
    module, requirement = GROUP_PACKAGES[group]
    if not group_options(group) and importlib.util.find_spec(module) is None:
        # No installed package ships this group at all: the package is missing, not the option.
        return f"\nThe '{group}' config group ships with {module.replace('_', '-')}, which is not installed: " + (
            f"pip install '{requirement}'"
        )
    installed = registry.describe(PLUGIN_GROUPS[group])
    lines = [f"\nInstalled {group} plugins ({PLUGIN_GROUPS[group]} entry points):"]
    lines += [f"\t{k}: {v}" for k, v in installed.items()] or ["\tnone"]
    if name in installed:
        lines.append(
            f"'{name}' is installed but registers no config '{group}/{name}': its package's roll.configs entry point "
            f"must register a config folder holding {group}/{name}.yaml or store a schema under that name"
        )
    else:
        close = difflib.get_close_matches(name, list(installed), n=1, cutoff=0.6)
        if close:
            lines.append(f"Did you mean '{group}={close[0]}'?")
    return "\n".join(lines)


def compose(
    overrides: Sequence[str] = (),
    config_name: str = "rlvr",
    conf_dir: str | Path | None = None,
    *,
    return_hydra_config: bool = False,
) -> DictConfig:
    """Compose `config_name` with Hydra overrides; raises `ConfigError` with an explained message.

    Searches `conf_dir` (default: the user's conf folder, if any) first, then every installed package's configs.

    Args:
        overrides: Hydra override strings, e.g. ["algo=ppo", "algo.lr=1e-6"].
        config_name: primary config (roll-core ships `rlvr`).
        conf_dir: a folder layered over the packaged configs; default `search_path.user_conf_dir()`.
        return_hydra_config: keep Hydra's own node (`cfg.hydra`: the job's override_dirname, run and sweep dirs).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from roll_core.registry import register_all_configs

    register_all_configs()  # each package registers its config folder (and schemas) here
    check_package_conflicts()
    primary = str(Path(conf_dir).resolve()) if conf_dir is not None else primary_config_path()
    GlobalHydra.instance().clear()
    try:
        if primary.startswith("pkg://"):
            init = initialize_config_module(config_module=primary.removeprefix("pkg://"), version_base=None)
        else:
            init = initialize_config_dir(config_dir=primary, version_base=None)
        with init:
            return hydra_compose(
                config_name=config_name, overrides=list(overrides), return_hydra_config=return_hydra_config
            )
    except Exception as exc:
        raise ConfigError(explain(exc)) from exc
    finally:
        GlobalHydra.instance().clear()


def check_unknown_keys(cfg: DictConfig, where: str = "") -> None:
    """Refuse keys that no schema declares, even ones forced in with Hydra's `+key=value` (which bypasses
    struct mode): a key nobody reads is a silently ignored setting."""
    obj_type = cfg._metadata.object_type
    known = {f.name for f in fields(obj_type)} if obj_type is not None and is_dataclass(obj_type) else None
    for key in cfg.keys():
        full = f"{where}.{key}" if where else str(key)
        if known is not None and key not in known:
            hint = did_you_mean(str(key), sorted(known), full)
            raise ConfigError(f"Key '{key}' not in '{obj_type.__name__}' (full_key: {full}). {hint}".rstrip())
        if OmegaConf.is_missing(cfg, key):
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig):
            check_unknown_keys(child, full)


def to_object(cfg: DictConfig) -> Any:
    """Resolve interpolations and instantiate the schema dataclasses (runs their `__post_init__` checks)."""
    check_unknown_keys(cfg)
    try:
        return OmegaConf.to_object(cfg)
    except Exception as exc:
        raise ConfigError(explain(exc)) from exc


def load_config(overrides: Sequence[str] = (), config_name: str = "rlvr", conf_dir: str | Path | None = None) -> Any:
    """`compose` then `to_object`: the typed config a pipeline takes."""
    return to_object(compose(overrides, config_name, conf_dir))
