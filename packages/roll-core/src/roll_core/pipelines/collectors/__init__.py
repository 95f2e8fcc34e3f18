"""Collectors: where a pipeline's batches come from. The loop asks, the trainer trains; nothing else differs.

Contract of a `Collector` (every implementation, in-tree or a `roll.collectors` plugin):
- `next(step, log)` returns the next scored batch (`Collected`: the batch in roll_core.protocol's layout with
  `behaviour_logprobs`, and per-row scores (B,)), or None when the step has nothing to train on. Its metrics and
  timers go to `log`. A batch generated under older weights carries `behaviour_version` (B,) long, never more
  than `pipeline.async_ratio` versions old; a trajectory batch carries `group_ids` and the turn tensors.
- `begin_sync()` / `finish_sync(version)` bracket every weight sync: stop submitting (pause, or abort requests in
  flight with partial rollout, to resume them under the new weights), then learn the new version and go on.
- `evaluate(step)` returns held-out metrics (`eval/accuracy` is what summaries and sweeps read).
- `state_dict()` / `load_state_dict(state)` hold what a resumed run needs to continue (the data position).
- `summary()` adds run totals to the run summary (reward failures, skipped data rows).
- `close()` stops background work. `plot_keys` names the metrics drawn in curves.png.
- `on_policy` (optional, default True): the collector samples from the current policy every step, so the weights
  are pushed to the engines after every update; False (files of rows) pushes them only before `evaluate`.
- `exhausted` (optional, default False): True once a collector with a finite job (rollout-only) has done it;
  the loop then checkpoints and ends the run before `pipeline.max_steps`.
- `empty_by_design` (optional, default False), read after `next` returned None: True when that None was meant
  (rollout-only: nothing trains; an evaluation-only step, a buffer warming up). Any other None is a step that
  trained nothing: warned about, counted in `data/empty_steps`, and `pipeline.max_empty_steps` of them in a row
  stop the run (roll_core.pipelines.empty_steps).

A collector factory may name its objective (`objective`, a `roll.objectives` entry point; `rl` when absent): the
update the Trainer runs on its batches (roll_core.pipelines.objectives).

A collector is built by a factory registered under `roll.collectors` and named by `pipeline.name`:
`factory(ctx: CollectorContext) -> Collector`. The built-ins: `rlvr` (prompts; asynchronous with
`pipeline.async_ratio > 0`) and `agentic` (episodes; asynchronous likewise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from roll_core.cluster.launch import Cluster
from roll_core.cluster.roles import InferGroup, TrainGroup
from roll_core.config.schema import RLVRConfig
from roll_core.errors import ConfigError
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch
from roll_core.tracking import Tracker


@dataclass
class Collected:
    """A scored batch to train on."""

    batch: Batch
    #: (B,) float: each row's score (the outcome reward; the episode reward for trajectories).
    scores: torch.Tensor


@dataclass
class CollectorContext:
    """What a collector may use: the run's config, cluster (for its own roles: reward workers, environment
    workers), the inference engines and rollout sampling, tokenizer, task (built from `env`), the resolved model
    path, and the tracker for sample logs (None when only evaluating: `roll-eval`)."""

    cfg: RLVRConfig
    cluster: Cluster
    infer: InferGroup
    sampling: SamplingParams
    tokenizer: Any
    task: Any
    model_path: str
    tracker: Tracker | None = None
    #: The actor's train group (None in rollout-only runs and in `roll-eval`): a collector may score held-out
    #: rows with it (an SFT run's evaluation loss).
    train: TrainGroup | None = None
    #: Frozen teachers by name (the objective's RoleNeeds.teachers): a collector may score rows with them.
    teachers: dict[str, TrainGroup] = field(default_factory=dict)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A few of the step's samples to the run's samples log (nowhere without a tracker)."""
        if self.tracker is not None:
            self.tracker.samples(step, rows)


@runtime_checkable
class Collector(Protocol):
    """Where batches come from (see the module docstring)."""

    plot_keys: tuple[str, ...]
    #: True when batches are trajectories (group ids and turns): the estimator must have a trajectory form.
    trajectories: bool

    def next(self, step: int, log: StepLog) -> Collected | None: ...

    def begin_sync(self) -> None: ...

    def finish_sync(self, version: int) -> None: ...

    def evaluate(self, step: int) -> dict[str, float | None]: ...  # None: a value with no estimate (a stderr of n<2)

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def summary(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class CollectorFactory(Protocol):
    """What a `roll.collectors` entry point loads to."""

    #: True when its batches are trajectories (checked against the estimator before anything is built).
    trajectories: bool

    def check(self, cfg: RLVRConfig, task: Any) -> None:
        """Raise ConfigError for a task or settings the collector cannot use: before any model loads."""
        ...

    def __call__(self, ctx: CollectorContext) -> Collector: ...


def refuse_async(cfg: Any, pipeline: str, why: str) -> None:
    """ConfigError for `pipeline.async_ratio` > 0 or `pipeline.partial_rollout` in a synchronous pipeline (nothing
    would read them; async_ratio would still keep a colocated engine awake: sleep_level 0)."""
    p = cfg.pipeline
    if p.async_ratio or p.partial_rollout:
        raise ConfigError(
            f"pipeline.async_ratio={p.async_ratio}, pipeline.partial_rollout={p.partial_rollout}: pipeline={pipeline} "
            f"{why}; set pipeline.async_ratio=0 (and pipeline.partial_rollout=false)"
        )


def refuse_reward_model(cfg: Any, pipeline: str, why: str) -> None:
    """ConfigError for `reward_model` other than none in a pipeline whose collector never builds it: only the prompt
    collectors (pipeline=rlvr, distill, rollout) score their rows with a reward model; elsewhere it was accepted and
    its scores silently never reached anything. `why` says what the pipeline trains on instead."""
    rm = getattr(cfg, "reward_model", None)
    if rm is not None and rm.enabled:
        raise ConfigError(
            f"reward_model={rm.name} with pipeline={pipeline}: {why}, and never builds the reward model (it scores the "
            "sampled responses of pipeline=rlvr, distill and rollout): set reward_model=none"
        )


class _Prompts:
    """`pipeline=rlvr`: prompts of a single-turn task, scored by its reward (asynchronous when async_ratio > 0)."""

    trajectories = False

    def check(self, cfg: RLVRConfig, task: Any) -> None:
        from roll_core.pipelines.collectors.prompts import check_task

        check_task(cfg, task)

    def __call__(self, ctx: CollectorContext) -> Collector:
        if ctx.cfg.pipeline.async_ratio > 0:
            from roll_core.pipelines.collectors.prompts_async import AsyncPromptCollector

            return AsyncPromptCollector(ctx)
        from roll_core.pipelines.collectors.prompts import PromptCollector

        return PromptCollector(ctx)


class _Episodes:
    """`pipeline=agentic`: multi-turn episodes against environments (asynchronous when async_ratio > 0)."""

    trajectories = True

    def check(self, cfg: RLVRConfig, task: Any) -> None:
        from roll_core.pipelines.collectors.episodes import check_task

        check_task(cfg, task)

    def __call__(self, ctx: CollectorContext) -> Collector:
        if ctx.cfg.pipeline.async_ratio > 0:
            from roll_core.pipelines.collectors.episodes_async import AsyncEpisodeCollector

            return AsyncEpisodeCollector(ctx)
        from roll_core.pipelines.collectors.episodes import EpisodeCollector

        return EpisodeCollector(ctx)


# Not named `prompts` / `episodes`: importing the submodules of those names would replace them on this package.
prompt_collectors = _Prompts()
episode_collectors = _Episodes()
