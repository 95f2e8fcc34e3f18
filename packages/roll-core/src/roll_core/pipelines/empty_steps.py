"""Steps that trained nothing, and the stop after too many of them in a row.

A collector's `next` returns None when its step has nothing to train on: every episode was dropped or aborted (an
inference engine failing every request), every prompt group was filtered out (dynamic sampling), no row had the
teacher prompt's fields. The loop goes on; when that happens every step, the run used to complete with exit 0
having trained nothing, and only its curves told.

Contract (the loop, roll_core.pipelines.loop, calls `count` once per training step, then `exceeded`):
- An empty step (no batch, not by design) logs one warning naming why from the step's own metrics (`REASONS`:
  e.g. `data/dropped_episodes`, `data/aborted_episodes`, `agent/engine_errors`, `data/dropped_groups`; "no reason
  in the step's metrics" when none is there), and its `data/empty_steps` metric is 1. Every other step logs 0:
  the metric is per step (0/1, so a resumed run needs no state for it), its sum over metrics.jsonl is the run's
  total (`total`, the summary's `empty_steps`).
- A step by design without a batch (`Collector.empty_by_design` true after `next` returned None: a rollout-only
  job, an evaluation-only step, a buffer warming up) is neither counted nor ends a streak: it logs 0.
- A step that trains ends the streak. After `limit` (pipeline.max_empty_steps) empty steps in a row, `exceeded`
  is true and `error(step)` is the message of the `EmptyStepsError` that stops the run: it names the streak, the
  key, the last step's reasons and what the user can do. `limit` 0: never stop (the warnings and metric remain).
- A resumed run's streak continues from its metrics (`resume(history)`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

#: Step metric: 1 on a step that trained nothing (not by design), else 0.
METRIC = "data/empty_steps"

#: The step metrics that say why a step had no batch, in the order they are named: (key, what it counts, what to
#: do). Those with a nonzero value are named in the warning and the stop's message.
REASONS: tuple[tuple[str, str, str], ...] = (
    ("agent/engine_errors", "requests the inference engine failed", "check the inference engine's log"),
    (
        "data/aborted_episodes",
        "episodes whose last request the engine refused or aborted",
        "check the inference engine (its memory, context length and restarts)",
    ),
    (
        "agent/failed_episodes",
        "agent programs that failed, by kind in agent/failed_*",
        "run the agent program by hand against the endpoint (env.on_failure=score trains failed episodes)",
    ),
    ("env/env_errors", "environment errors", "check the environment's log"),
    ("env/env_timeouts", "environment timeouts", "check the environment, or raise its step timeout"),
    ("data/reset_failed_episodes", "episodes whose environment failed at reset", "check the environment's log"),
    (
        "data/context_refused_episodes",
        "episodes whose first prompt left no room within the context",
        "raise env.max_context_length (and infer_engine.max_model_len) or shorten the task's first observation",
    ),
    ("data/dropped_episodes", "episodes dropped: no sampled turn, aborted, or failed with env.on_failure=drop", ""),
    (
        "data/dropped_groups",
        "prompt groups filtered out by algo.drop_uniform_groups: every response scored the same",
        "check the reward (reward/mean) and the task's difficulty for the model, or set algo.drop_uniform_groups=false",
    ),
    (
        "data/refused_prompts",
        "prompt groups the inference engine refused",
        "lower model.max_prompt_length or give the engine more memory",
    ),
    (
        "data/skipped_teacher_prompt_rows",
        "rows without the fields distill.teacher_prompt names",
        "give the rows those fields or change distill.teacher_prompt",
    ),
    ("reward/errors", "rows whose reward raised", "run the reward on a few rows by hand"),
    ("reward/timeouts", "rows whose reward timed out", "raise pipeline.reward_timeout_s"),
    ("reward/nonfinite", "rows whose reward was NaN/inf", "run the reward on a few rows by hand"),
)


class EmptyStepsError(RuntimeError):
    """`pipeline.max_empty_steps` steps in a row trained nothing: the run stops."""


def reasons(out: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The `REASONS` entries whose metric is in `out` with a nonzero value, as (`key=value`, what, what to do)."""
    found = []
    for key, what, todo in REASONS:
        value = out.get(key)
        if isinstance(value, (int, float)) and value:
            found.append((f"{key}={value:g}", what, todo))
    return found


def describe(out: Mapping[str, Any]) -> str:
    """Why a step had no batch, from its metrics: `key=value, what` for each reason, or a line saying none."""
    found = reasons(out)
    if not found:
        return "no reason in the step's metrics (the collector returned no batch)"
    return "; ".join(f"{kv}, {what}" for kv, what, _ in found)


class EmptySteps:
    """Counts the steps that trained nothing and says when to stop (see the module docstring).

    Args:
        limit: pipeline.max_empty_steps: empty steps in a row that stop the run; 0 never stops.
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"pipeline.max_empty_steps={limit} must be >= 0 (0: never stop)")
        self.limit = limit
        self.streak = 0  # empty steps in a row, up to the last one counted
        self.last_reason = ""

    def count(self, step: int, out: dict[str, Any], *, trained: bool, by_design: bool = False) -> None:
        """Record step `step`: `trained` (the collector gave a batch) or not, `by_design` (its None was meant);
        sets `out[METRIC]` and warns about an empty step."""
        empty = not trained and not by_design
        out[METRIC] = 1.0 if empty else 0.0
        if trained:
            self.streak = 0
        if not empty:
            return
        self.streak += 1
        self.last_reason = describe(out)
        of = f" of pipeline.max_empty_steps={self.limit}" if self.limit else ""
        log.warning("step %d trained nothing (%d in a row%s): %s", step, self.streak, of, self.last_reason)

    @property
    def exceeded(self) -> bool:
        """Whether the streak reached the limit (never with limit 0)."""
        return bool(self.limit) and self.streak >= self.limit

    def error(self, step: int, out: Mapping[str, Any]) -> str:
        """The stop's message after step `step` (whose metrics are `out`): the streak, the reasons, what to do."""
        todo = [t for _, _, t in reasons(out) if t]
        todo = list(dict.fromkeys(todo))  # once each, in REASONS' order
        todo.append("the warnings above name each step's cause")
        return (
            f"step {step}: {self.streak} steps in a row trained nothing (pipeline.max_empty_steps={self.limit}); "
            f"the last one: {self.last_reason}. What to do: {'; '.join(todo)}. pipeline.max_empty_steps=0 never "
            "stops (the metric data/empty_steps still counts them)"
        )

    def resume(self, history: Iterable[Mapping[str, Any]]) -> None:
        """Continue the streak of a resumed run: the empty steps at the end of its metrics records."""
        self.streak = 0
        for record in history:
            if METRIC in record:
                self.streak = self.streak + 1 if record[METRIC] else 0


def total(history: Iterable[Mapping[str, Any]]) -> int:
    """The run's empty steps: the sum of `data/empty_steps` over its metrics records."""
    return int(sum(record.get(METRIC) or 0 for record in history))
