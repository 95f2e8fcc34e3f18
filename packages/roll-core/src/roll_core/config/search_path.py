"""Where roll's Hydra configs come from: config groups shipped inside the installed packages, plus the user's folder.

Each package carries its YAML groups as package data (`roll_core/conf`: the primary `rlvr.yaml`, `algo/`, `model/`,
`hw/`, `cluster/`, `pipeline/`, `hydra/launcher/`, the product's experiments; `roll_engines/conf`: `train_engine/`,
`infer_engine/`; `roll_envs/conf`: `env/`) and names that folder's module from its `roll.configs` entry point with
`add_config_package("roll_engines.conf")`. roll-core's Hydra search-path plugin (`hydra_plugins/roll_searchpath.py`)
appends every registered module to Hydra's search path, so `compose()` and `roll-train` (`@hydra.main`) see the
groups of exactly what is installed: without roll-envs there is no `env` group. A wheel install therefore works
from any folder.

The user's folder (`user_conf_dir()`: `$ROLL_CONF_DIR`, else `./conf`, else the repository's `conf/` beside an
editable install) is Hydra's primary config path, searched before every package: experiments and sweeps a user
writes live there, and a file with the same group and name replaces the packaged one.

Two installed packages may not ship the same option (`algo/grpo.yaml` in roll-core and in a plugin): which one Hydra
composed would depend on the search order, so `check_package_conflicts()` (called by `compose` and `roll-train`)
refuses it, naming both packages. Replacing a packaged option is what the user's folder is for.

Contract: packages register importable module names (a folder with an `__init__.py`, which Hydra's `pkg://` source
requires), never file paths; registering twice is a no-op; the plugin adds nothing until a `register_configs()` has
registered a module in this process, so other Hydra applications in the same environment are untouched.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError

__all__ = [
    "PRIMARY_PACKAGE",
    "add_config_package",
    "check_package_conflicts",
    "config_dirs",
    "config_packages",
    "extend_search_path",
    "group_options",
    "package_dir",
    "primary_config_path",
    "user_conf_dir",
]

#: The module holding the primary config (`rlvr.yaml`).
PRIMARY_PACKAGE = "roll_core.conf"

# Registration order is search order among packages; a user's folder always comes first.
_packages: list[str] = []


def add_config_package(module: str) -> None:
    """Put `module` (an importable package holding config groups, e.g. "roll_engines.conf") on roll's search path.

    Called from a package's `register_configs()` (its `roll.configs` entry point). Idempotent.
    """
    if module not in _packages:
        _packages.append(module)


def config_packages() -> list[str]:
    """The config modules of the installed packages, in search order (registering them first, as `compose` does)."""
    from roll_core.registry import register_all_configs

    register_all_configs()
    return list(_packages)


def user_conf_dir() -> Path | None:
    """The user's config folder layered over the packaged configs, or None when there is none.

    `$ROLL_CONF_DIR` when set (it must be a folder), else `./conf`, else the repository's `conf/` when roll-core
    is installed editable from a checkout (so the repository's experiments compose from any working folder).

    Raises:
        ConfigError: `$ROLL_CONF_DIR` names something that is not a folder.
    """
    if os.environ.get("ROLL_CONF_DIR"):
        path = Path(os.environ["ROLL_CONF_DIR"]).expanduser()
        if not path.is_dir():
            raise ConfigError(f"ROLL_CONF_DIR={path} is not a folder: point it at your conf/ folder or unset it")
        return path.resolve()
    if (Path.cwd() / "conf").is_dir():
        return (Path.cwd() / "conf").resolve()
    for parent in Path(__file__).resolve().parents:
        # A checkout: roll-core's pyproject sits under packages/ next to conf/. Never true for a wheel install.
        if (parent / "packages" / "roll-core" / "pyproject.toml").is_file() and (parent / "conf").is_dir():
            return parent / "conf"
    return None


def primary_config_path() -> str:
    """Hydra's primary config path: the user's folder, else roll-core's packaged configs (`pkg://roll_core.conf`)."""
    user = user_conf_dir()
    return str(user) if user is not None else f"pkg://{PRIMARY_PACKAGE}"


def package_dir(module: str) -> Path | None:
    """The folder of an installed config module on disk, or None when it is not installed."""
    try:
        folder = resources.files(module)
    except (ModuleNotFoundError, TypeError, ValueError):
        return None
    return Path(str(folder)) if folder.is_dir() else None


def config_dirs() -> list[Path]:
    """Every config folder in search order: the user's (if any), then each installed package's."""
    dirs = [d for d in (user_conf_dir(), *(package_dir(m) for m in config_packages())) if d is not None]
    return list(dict.fromkeys(dirs))


def group_options(group: str) -> dict[str, Path]:
    """option name -> the YAML file Hydra picks for `group=option` (the first folder that has it wins).

    `group` may be nested ("hydra/launcher"). ConfigStore-only options (schemas, plugins' nodes) are not listed.
    """
    found: dict[str, Path] = {}
    for folder in config_dirs():
        for path in sorted((folder / group).glob("*.yaml")):
            found.setdefault(path.stem, path)
    return dict(sorted(found.items()))


def check_package_conflicts() -> None:
    """Refuse a config option (group/name, or a primary config such as `rlvr`) that two installed packages ship.

    Hydra takes the first match on its search path, and the packages' order there is not a contract (a user folder,
    or its absence, shifts it): a plugin's `algo/grpo.yaml` would silently win in one working folder and lose in
    another. The user's folder is exempt: it is searched first on purpose.

    Raises:
        ConfigError: some option is shipped by more than one package; the message names each and both modules.
    """
    owners: dict[str, list[str]] = {}
    for module in config_packages():
        folder = package_dir(module)
        if folder is None:
            continue
        for path in folder.rglob("*.yaml"):
            owners.setdefault(path.relative_to(folder).with_suffix("").as_posix(), []).append(module)
    clashes = {option: mods for option, mods in sorted(owners.items()) if len(mods) > 1}
    if clashes:
        listed = "; ".join(f"{option} ({' and '.join(mods)})" for option, mods in clashes.items())
        raise ConfigError(
            f"config options shipped by more than one installed package: {listed}. Which one runs would depend on "
            "the search order: rename the plugin's file (a new option name), or put your replacement in your own "
            "conf folder ($ROLL_CONF_DIR or ./conf), which is searched first"
        )


def extend_search_path(search_path: Any) -> None:
    """Append every registered config module to a Hydra `ConfigSearchPath` (called by roll's search-path plugin).

    A module already on the path (the primary one, when no user folder exists) is not added twice.
    """
    present = {element.path for element in search_path.get_path()}
    for module in _packages:
        entry = f"pkg://{module}"
        if entry not in present:
            search_path.append(provider=f"roll:{module}", path=entry)
