"""Compose, validate and materialise run configs; turn Hydra/OmegaConf errors into actionable messages.

- `find_conf_dir()` locates the user-facing YAML tree (`$ROLL_CONF_DIR`, then `./conf`, then the repository's
  `conf/` next to an editable install, then the copy packaged inside roll-core).
- `compose(overrides)` composes a primary config (Hydra compose API) without building anything.
- `to_object(cfg)` turns the DictConfig into dataclasses once, at the entry point, running every `__post_init__`.
- `explain(exc)` walks an exception chain for the OmegaConf error that names a key and adds "did you mean".
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from roll_core.errors import ConfigError

__all__ = ["ConfigError", "compose", "explain", "find_conf_dir", "load_config", "to_object"]


def find_conf_dir() -> Path:
    """The folder holding `rlvr.yaml` and the config groups."""
    candidates: list[Path] = []
    if os.environ.get("ROLL_CONF_DIR"):
        candidates.append(Path(os.environ["ROLL_CONF_DIR"]))
    candidates.append(Path.cwd() / "conf")
    here = Path(__file__).resolve()
    candidates += [parent / "conf" for parent in here.parents]
    candidates.append(here.parent.parent / "_conf")
    for cand in candidates:
        if (cand / "rlvr.yaml").is_file():
            return cand
    tried = "\n  ".join(str(c) for c in candidates[:3] + candidates[-1:])
    raise ConfigError(f"cannot find roll's conf/ folder (looked for rlvr.yaml in):\n  {tried}\nset ROLL_CONF_DIR")


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

    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    lines = [line for e in chain for line in str(e).strip().splitlines()]
    # Hydra suggests "+key=value" for unknown keys, which a structured config rejects too; OmegaConf repeats
    # its message as an unformatted template. Neither helps a user.
    lines = [ln for ln in lines if ln.strip() and not ln.startswith("To append to your config") and "$VALUE" not in ln]
    message = "\n".join(dict.fromkeys(lines))
    message += _installed_plugins_hint(message)
    for err in chain:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "key", None) is not None:
            key = str(err.key)
            candidates = _dataclass_fields(getattr(err, "object_type", None))
            # An existing key means the value is what is wrong, and the message already says why.
            if key not in candidates:
                hint = did_you_mean(key, candidates, getattr(err, "full_key", None) or key)
                message += f"\n{hint}" if hint else ""
                if not hint and candidates:
                    message += f"\nValid keys here: {', '.join(candidates)}"
            break
    return message


#: Config groups whose options are plugins, and the entry-point group that says what is installed.
PLUGIN_GROUPS = {"infer_engine": "roll.infer_engines", "train_engine": "roll.train_engines", "env": "roll.envs"}


def _installed_plugins_hint(message: str) -> str:
    """For an unknown `infer_engine=x` (or train_engine, env): what is installed, and the closest name."""
    import re

    from roll_core import registry

    found = re.search(r"Could not find '(\w+)/([\w.-]+)'", message)
    if not found or found.group(1) not in PLUGIN_GROUPS:
        return ""
    group, name = found.groups()
    installed = registry.describe(PLUGIN_GROUPS[group])
    lines = [f"\nInstalled {group} plugins ({PLUGIN_GROUPS[group]} entry points):"]
    lines += [f"\t{k}: {v}" for k, v in installed.items()] or ["\tnone"]
    if name in installed:
        lines.append(
            f"'{name}' is installed but registers no config '{group}/{name}': its package must store a schema "
            "under that name in a roll.configs entry point"
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
) -> DictConfig:
    """Compose `config_name` with Hydra overrides; raises `ConfigError` with an explained message.

    Args:
        overrides: Hydra override strings, e.g. ["algo=ppo", "algo.lr=1e-6"].
        config_name: primary config in the conf folder.
        conf_dir: the conf folder; default `find_conf_dir()`.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from roll_core.registry import register_all_configs

    register_all_configs()
    conf = Path(conf_dir) if conf_dir is not None else find_conf_dir()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf.resolve()), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
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
