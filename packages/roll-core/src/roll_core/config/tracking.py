"""Config schema of the `tracking` node: run naming and grouping, and each tracker backend's own options.

Which backends a run writes to is `pipeline.trackers` (a list: `pipeline.trackers=[tensorboard,wandb]`, the one way
to pick several); how each one writes is its node here: `tracking.wandb.project=demo`, `tracking.mlflow.tracking_uri
=http://...`. An option of a backend that is not in `pipeline.trackers` is accepted and unused. Unknown keys are
errors like everywhere else; an out-of-tree backend reads its options from `tracking.plugins.<its name>` (free-form:
the backend checks them), and a name there that no installed plugin has (or a built-in's) is refused.

Backends receive the whole resolved config (the `config` keyword of `TrackerBackend`) and read their node with
`backend_options(config, "wandb")`, which validates it again: a backend built by a script, without a composed
config, gets the defaults.

Deliberately free of imports from roll_core.config.schema, which imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from roll_core.errors import Extra

#: The optional packages of the service backends (each backend class points at its own as `extra`).
WANDB = Extra("wandb", "pipeline.trackers=[wandb]", "wandb", "roll-core[wandb]")
MLFLOW = Extra("mlflow", "pipeline.trackers=[mlflow]", "mlflow", "roll-core[mlflow]")
SWANLAB = Extra("swanlab", "pipeline.trackers=[swanlab]", "swanlab", "roll-core[swanlab]")

WANDB_MODES = ("auto", "online", "offline", "disabled")
SWANLAB_MODES = ("auto", "cloud", "local", "offline", "disabled")


def _check(name: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"tracking.{name}: {message}")


@dataclass
class WandbConfig:
    """`pipeline.trackers=[wandb]`: Weights & Biases (the `roll-core[wandb]` extra)."""

    # W&B project; null: "roll".
    project: str | None = None
    # W&B entity (user or team); null: the API key's default entity.
    entity: str | None = None
    # auto: WANDB_MODE when set, else online when an API key is found (WANDB_API_KEY or a login in ~/.netrc), else
    # offline (files under <run>/wandb, upload later with `wandb sync <run>/wandb/offline-run-*`) | online |
    # offline | disabled (nothing written).
    mode: str = "auto"
    # W&B group; null: tracking.group (a sweep's jobs share one).
    group: str | None = None
    # W&B tags.
    tags: list[str] = field(default_factory=list)
    # W&B job type (e.g. train, eval); null: none.
    job_type: str | None = None
    # Free-text notes shown with the run.
    notes: str | None = None
    # Folder W&B writes under (it adds wandb/); null: the run's folder, so files land in <run>/wandb.
    dir: str | None = None
    # Log sample completions as a W&B table ("samples": prompt, response, reward, ... per step).
    log_samples: bool = True

    def __post_init__(self) -> None:
        _check("wandb.mode", self.mode in WANDB_MODES, f"{self.mode!r} is not one of {', '.join(WANDB_MODES)}")


@dataclass
class MlflowConfig:
    """`pipeline.trackers=[mlflow]`: MLflow (the `roll-core[mlflow]` extra)."""

    # MLflow tracking URI (http://host:5000, sqlite:///path.db, databricks); null: MLFLOW_TRACKING_URI when set,
    # else a SQLite store in the run folder (sqlite:///<run>/mlflow/mlflow.db, artifacts in <run>/mlflow/artifacts).
    tracking_uri: str | None = None
    # MLflow experiment name; null: tracking.group (a sweep), else the run's `experiment`.
    experiment: str | None = None
    # Tags set on the MLflow run.
    tags: dict[str, str] = field(default_factory=dict)
    # Log sample completions as MLflow table artifacts (samples/step_<step>.json).
    log_samples: bool = True
    # Seconds one HTTP request to the server may take (MLFLOW_HTTP_REQUEST_TIMEOUT, when set, wins).
    timeout_s: int = 15
    # MLflow's own retries of one failed request (MLFLOW_HTTP_REQUEST_MAX_RETRIES, when set, wins).
    retries: int = 2
    # After a failed send, seconds before the buffered points are sent again (doubles per failure, up to 300);
    # training goes on meanwhile (roll_core.trackers.mlflow).
    retry_interval_s: float = 10.0
    # Metric points kept in memory while the server is away (sent when it answers); past it the oldest are dropped,
    # counted and warned about (metrics.jsonl keeps them).
    max_buffered_points: int = 100_000
    # Seconds the end of the run may wait for the server in all (close): what is still unsent then is counted and
    # warned about, metrics.jsonl keeps it, and a resume sends it. Its last second is kept for writing unsent.json.
    close_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _check(
            "mlflow.max_buffered_points", self.max_buffered_points >= 1, f"must be >= 1, got {self.max_buffered_points}"
        )
        # MLflow's request timeout is whole seconds and close's requests end 1 s before the deadline: at 3 s, a
        # close has one second to start its requests in.
        _check("mlflow.close_timeout_s", self.close_timeout_s >= 3, f"must be at least 3, got {self.close_timeout_s}")
        _check("mlflow.timeout_s", self.timeout_s >= 1, f"must be at least 1, got {self.timeout_s}")
        _check("mlflow.retries", self.retries >= 0, f"must be >= 0, got {self.retries}")
        _check("mlflow.retry_interval_s", self.retry_interval_s >= 0, f"must be >= 0, got {self.retry_interval_s}")


@dataclass
class SwanlabConfig:
    """`pipeline.trackers=[swanlab]`: SwanLab (the `roll-core[swanlab]` extra)."""

    # SwanLab project; null: "roll".
    project: str | None = None
    # SwanLab workspace (user or organisation); null: the logged-in user's.
    workspace: str | None = None
    # auto: SWANLAB_MODE when set, else cloud when logged in (SWANLAB_API_KEY or `swanlab login`), else local |
    # cloud | local (files under the logdir, no network; `swanlab watch <logdir>`) | offline (the backup file only;
    # `swanlab sync` uploads it) | disabled.
    mode: str = "auto"
    # SwanLab group (SwanLab 0.6 has none: it becomes a tag); null: tracking.group (a sweep's jobs share one).
    group: str | None = None
    # SwanLab tags.
    tags: list[str] = field(default_factory=list)
    # Folder SwanLab writes its logs under; null: <run>/swanlog.
    logdir: str | None = None
    # Log sample completions as SwanLab text (a `samples` column: each row as JSON, its reward as caption).
    log_samples: bool = True
    # SwanLab's hardware monitor (CPU, memory, GPU charts; a thread polling every few seconds).
    hardware_monitor: bool = True

    def __post_init__(self) -> None:
        _check("swanlab.mode", self.mode in SWANLAB_MODES, f"{self.mode!r} is not one of {', '.join(SWANLAB_MODES)}")


@dataclass
class TrackingConfig:
    """Run naming and grouping shared by every tracker backend, and each backend's options."""

    # Name of the run in trackers; null: the `experiment` (a sweep job: "<experiment>-<job number>[<overrides>]").
    run_name: str | None = None
    # Group of related runs (W&B group, MLflow experiment, SwanLab group); null: none. A Hydra multirun sets it to
    # "<experiment>-<sweep folder name>" unless given.
    group: str | None = None
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    swanlab: SwanlabConfig = field(default_factory=SwanlabConfig)
    # Options of out-of-tree tracker backends, keyed by their `roll.trackers` name (free-form; the backend checks).
    plugins: dict[str, Any] = field(default_factory=dict)
    # Bounds on samples.jsonl (and the sample tables backends get), which every step appends to: a long run's file
    # grew without limit. At most this many of the rows a step logs are kept (its first ones); the last kept row
    # then holds `rows_left_out`, the number dropped. 0: no sample rows are written.
    samples_per_step: int = 16
    # Characters of one text value in a sample row (a response, a turn's text): a longer one keeps its first and last
    # halves around a "[... N characters cut ...]" marker (a response's end holds its answer). 0: no limit.
    sample_max_chars: int = 4000

    def __post_init__(self) -> None:
        for name in self.plugins:
            _check_plugin_options(str(name))
        _check("samples_per_step", self.samples_per_step >= 0, f"must be >= 0, got {self.samples_per_step}")
        _check(
            "sample_max_chars", self.sample_max_chars >= 0, f"must be >= 0 (0: no limit), got {self.sample_max_chars}"
        )


#: Backends whose options have a typed node of their own (`tracking.<name>`), never read from `tracking.plugins`.
TYPED_BACKENDS = ("wandb", "mlflow", "swanlab")


def _check_plugin_options(name: str) -> None:
    """Refuse `tracking.plugins.<name>` that no backend reads: a built-in's options (typed, `tracking.wandb.*`; the
    tensorboard and jsonl backends take none) or a name no installed `roll.trackers` plugin has (a misspelt one):
    its options were silently dropped while the plugin ran on its defaults."""
    import difflib

    from roll_core import registry

    if name in TYPED_BACKENDS:
        raise ValueError(f"tracking.plugins.{name}: {name}'s options are tracking.{name}.<key>, not tracking.plugins")
    installed = registry.describe("roll.trackers")
    builtin = sorted(k for k, v in installed.items() if v.startswith("roll_core.") and k not in TYPED_BACKENDS)
    if name in builtin:
        raise ValueError(f"tracking.plugins.{name}: the built-in {name} tracker takes no options")
    plugins = sorted(k for k in installed if k not in TYPED_BACKENDS and k not in builtin)
    if name not in plugins:
        close = difflib.get_close_matches(name, plugins, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(
            f"tracking.plugins.{name}: no installed tracker plugin is named {name!r}{hint}; tracker plugins "
            f"(roll.trackers entry points): {', '.join(plugins) or 'none'}"
        )


def tracking_config(config: Mapping[str, Any] | None) -> TrackingConfig:
    """The typed `tracking` node of a resolved run config given as plain containers (what backends receive).

    A config without the node (a script's `Tracker(dir)`) gets the defaults; a wrong key or value raises
    ValueError naming it, as at composition.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    node = (config or {}).get("tracking") or {}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrackingConfig), node)
        typed = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ValueError(f"tracking: {str(exc).splitlines()[0]}") from None
    assert isinstance(typed, TrackingConfig)
    return typed


def backend_options(config: Mapping[str, Any] | None, name: str) -> Any:
    """The options node of backend `name` (`tracking.<name>`, or `tracking.plugins.<name>` for an out-of-tree one:
    then a plain dict, `{}` when absent)."""
    typed = tracking_config(config)
    if name in ("wandb", "mlflow", "swanlab"):
        return getattr(typed, name)
    return dict(typed.plugins.get(name) or {})
