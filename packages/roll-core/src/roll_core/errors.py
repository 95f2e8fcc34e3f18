"""Errors shared across roll-core that must be importable without Hydra/OmegaConf (device checks, engines).

Optional dependencies: every package declares the extras its components need as `Extra` constants (roll-core's
below, roll-engines' and roll-envs' in their `config` modules). An import site loads the module with
`Extra.load()`; a config schema says what a run of it needs with a `check_installed()` method that calls
`Extra.require()`; `check_installed(cfg)` runs them all on a typed run config, which the CLI does before it
builds anything. Either way a missing package is one line naming the pip extra that installs it
(`MissingExtraError`), never a `ModuleNotFoundError` from deep inside a build.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from types import ModuleType
from typing import Any


class ConfigError(ValueError):
    """A run config is invalid; the message names the key and, where close, the right spelling."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message is one line naming the pip extra to install."""


@dataclasses.dataclass(frozen=True)
class Extra:
    """An optional dependency: the module a component imports, the distribution and the pip extra bringing it.

    Args:
        module: the import name, e.g. "megatron.core".
        what: the setting that needs it, as a user writes it, e.g. "train_engine=megatron".
        dist: the distribution on PyPI, e.g. "megatron-core".
        extra: what to pip install, e.g. "roll-engines[megatron]".
        hint: appended to the message (other ways to get it), e.g. "; on CPU: nox -s vllm_venv".
        also: other modules the extra installs for it (their absence at import is the same missing extra).
    """

    module: str
    what: str
    dist: str
    extra: str
    hint: str = ""
    also: tuple[str, ...] = ()

    def message(self) -> str:
        return f"{self.what} needs {self.dist}: pip install '{self.extra}'{self.hint}"

    def error(self) -> MissingExtraError:
        return MissingExtraError(self.message())

    def installed(self) -> bool:
        """True when the module can be found here (without importing it; a parent package may be imported)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):  # a missing parent package, or a module set to None in sys.modules
            return False

    def require(self) -> None:
        """Raise `MissingExtraError` unless the module is installed here."""
        if not self.installed():
            raise self.error() from None

    def load(self) -> ModuleType:
        """Import the module; its absence (not an error inside it) becomes `MissingExtraError`."""
        try:
            return importlib.import_module(self.module)
        except ModuleNotFoundError as exc:
            ours = (self.module, *self.also)
            if exc.name is None or any(m == exc.name or m.startswith(exc.name + ".") for m in ours):
                raise self.error() from exc
            raise  # the package is there but something it imports is not: its own message says what


def missing_extra(what: str, dist: str, extra: str, hint: str = "") -> MissingExtraError:
    """The one-line error for a missing optional dependency, e.g.
    `train_engine=megatron needs megatron-core: pip install 'roll-engines[megatron]'`."""
    return Extra("", what, dist, extra, hint).error()


# roll-core's own extras (roll-core[ray,track,gguf,sweep]).
RAY = Extra("ray", "cluster=ray", "Ray", "roll-core[ray]")
TENSORBOARD = Extra("tensorboard", "run tracking (TensorBoard logs)", "tensorboard", "roll-core[track]")
GGUF = Extra("gguf", "converting a GGUF model (model.path=builtin:smollm2-135m ...)", "gguf", "roll-core[gguf]")
#: Hydra plugins a sweep names (`hydra/launcher=ray`, `hydra/sweeper=optuna`): with each, the text its absence leaves
#: in Hydra's error (a launcher class it cannot find, a sweeper option or target it cannot locate).
SWEEP_PLUGINS: tuple[tuple[tuple[Extra, ...], tuple[str, ...]], ...] = (
    (
        (
            Extra(
                "hydra_plugins.hydra_ray_launcher.ray_launcher",
                "hydra/launcher=ray",
                "hydra-ray-launcher",
                "roll-core[sweep]",
            ),
            Extra("ray", "hydra/launcher=ray", "Ray", "roll-core[sweep]"),
        ),
        ("roll_ray_launcher", "hydra_ray_launcher", "hydra/launcher/ray"),
    ),
    (
        (
            Extra(
                "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper",
                "hydra/sweeper=optuna",
                "hydra-optuna-sweeper",
                "roll-core[sweep]",
            ),
            Extra("optuna", "hydra/sweeper=optuna", "Optuna", "roll-core[sweep]"),
        ),
        ("optuna",),
    ),
)


def exception_chain(exc: BaseException) -> list[BaseException]:
    """`exc` and what caused it (`__cause__`, else `__context__`), outermost first, each once."""
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return chain


def missing_sweep_plugin(exc: BaseException) -> MissingExtraError | None:
    """The one-line error for a Hydra failure that a missing sweep plugin (roll-core[sweep]) caused, else None.

    Hydra reports a missing launcher as "Unknown plugin class" and a missing sweeper as an option it cannot find,
    with a traceback; `roll-train` asks here first, reading the messages of `exc` and its causes.
    """
    text = "\n".join(str(e).lower() for e in exception_chain(exc))
    for extras, marks in SWEEP_PLUGINS:
        if any(mark in text for mark in marks):
            for extra in extras:
                if not extra.installed():
                    return extra.error()
    return None


def check_installed(cfg: Any, *, training: bool = True) -> None:
    """Raise `MissingExtraError` for the first optional dependency the typed run config `cfg` needs and this
    environment lacks: roll-core's (Ray, TensorBoard) and each group's, through the `check_installed()` method
    of its schema (nested schemas, such as an env's reward, included).

    Components that run in another Python environment (`infer_engine.python`) check themselves. On a cluster
    joined by address the workers may have what the driver lacks: only the driver's own needs are checked.
    `training=False` (roll-eval, in-process) leaves out what only a training run uses (Ray, TensorBoard, the
    train engine).
    """
    cluster = getattr(cfg, "cluster", None)
    if training:
        # Each tracker's package (its class's `extra`, roll_core.interfaces.tracking), before anything is built.
        from roll_core import registry

        for name in getattr(getattr(cfg, "pipeline", None), "trackers", ("tensorboard",)):
            extra = getattr(registry.load("roll.trackers", name), "extra", None)
            if extra is not None:
                extra.require()
        if getattr(cluster, "backend", "local") == "ray":
            RAY.require()
        if getattr(cluster, "address", None) is not None:
            return
    seen: set[int] = set()

    def visit(node: Any) -> None:
        if isinstance(node, (dict, list, tuple)):  # env=multi's env.tasks, env.rewards: nodes inside containers
            for item in node.values() if isinstance(node, dict) else node:
                visit(item)
            return
        if id(node) in seen or not dataclasses.is_dataclass(node) or isinstance(node, type):
            return
        seen.add(id(node))
        check = getattr(node, "check_installed", None)
        if callable(check):
            check()
        for f in dataclasses.fields(node):
            visit(getattr(node, f.name, None))

    for f in dataclasses.fields(cfg):
        if training or f.name != "train_engine":
            visit(getattr(cfg, f.name, None))
