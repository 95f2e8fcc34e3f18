"""A run's last held-out evaluation, read from its metrics history (metrics.jsonl records, as a resume leaves them).

Contract (pure functions of the history, except `no_outcome_in`, which reads a run folder's metrics.jsonl):
- An evaluation is a record holding `eval/accuracy` or `eval/n` (every pipeline's evaluation logs `eval/n`; an
  episode collector none of whose held-out episodes had an outcome logs `eval/n` 0 and no `eval/accuracy`:
  roll_core.pipelines.collectors._episode_drops). `last_evaluation` is the latest one, None without any.
- `last_eval_accuracy` is that evaluation's own `eval/accuracy` (a NaN as logged), None when it logged none: never
  an earlier evaluation's, which would pass for the final model's (the rule of the run summary's
  `final_eval_accuracy`, roll_core.pipelines._run_summary). The last LOGGED accuracy is not the last evaluation's.
- `no_outcome` says why the last evaluation has no accuracy when it had no outcome (`last evaluation (step 4) had
  no outcome (eval/n 0: eval/reset_failed_episodes=4)`), None when it has one or there is no evaluation.
- `last_evaluation_size` is the held-out problems (episodes) the last evaluation logging `eval/n` ran: its `eval/n`
  plus the episodes it counted out of `eval/n` for want of an outcome (`_NOT_ATTEMPTED`) and the problems it skipped
  unscored (`SKIPPED`), so an evaluation none of whose 4 episodes had an outcome ran 4, not `eval/n`'s 0 (report.md
  read "on 0 held-out problems"), and one that scored 6 of its 8 problems (2 prompts over model.max_prompt_length)
  ran 8, its held-out set's size; None when no record logged `eval/n`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

#: What an evaluation with no outcome logged instead, most telling first (the episode collectors' counts).
_NOT_ATTEMPTED = ("eval/reset_failed_episodes", "eval/context_refused_episodes", "eval/aborted_episodes")

#: The held-out problems a prompt-based evaluation skipped, never scored nor in `eval/n`, by its result's key
#: (roll_core.pipelines.rollout.evaluate) -> the metric `eval_log` logs it as (the training's data/ counters' names):
#: a prompt over model.max_prompt_length, one filling the engine's context, pictures that could not be read.
SKIPPED = {
    "skipped_long": "eval/skipped_long_prompts",
    "skipped_context": "eval/skipped_context_prompts",
    "skipped_bad_images": "eval/skipped_bad_images",
}


def last_evaluation(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The history's last evaluation record (module docstring), None when nothing was evaluated."""
    return next((h for h in reversed(history) if "eval/accuracy" in h or "eval/n" in h), None)


def last_eval_accuracy(history: list[dict[str, Any]]) -> Any:
    """The last evaluation's own accuracy: None when it logged none (nothing attempted) or nothing was evaluated."""
    last = last_evaluation(history)
    return last.get("eval/accuracy") if last is not None else None


def last_evaluation_size(history: list[dict[str, Any]]) -> int | None:
    """The held-out problems the last evaluation that logged `eval/n` ran (see the module docstring); None when none
    logged one."""
    last = next((h for h in reversed(history) if _count(h.get("eval/n"))), None)
    if last is None:
        return None
    left_out = (*_NOT_ATTEMPTED, *SKIPPED.values())
    return int(last["eval/n"]) + sum(int(last[k]) for k in left_out if _count(last.get(k)))


def _count(v: Any) -> bool:
    """A logged count: a finite number, not a bool (a NaN or a string is no count)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def no_outcome(history: list[dict[str, Any]]) -> str | None:
    """Why the last evaluation logged no accuracy (see the module docstring); None when it logged one or none ran."""
    last = last_evaluation(history)
    if last is None or last.get("eval/accuracy") is not None:
        return None
    counts = [f"{k}={last[k]:g}" for k in _NOT_ATTEMPTED if isinstance(last.get(k), (int, float)) and last[k]]
    n = last.get("eval/n")
    what = f"eval/n {n:g}" if isinstance(n, (int, float)) else "no eval/accuracy"
    return f"last evaluation (step {last.get('step')}) had no outcome ({what}" + (
        f": {', '.join(counts)})" if counts else ")"
    )


def no_outcome_in(folder: str | Path | None) -> str | None:
    """`no_outcome` of the run in `folder` (its metrics.jsonl; None without a folder or a file)."""
    if not folder:
        return None
    from roll_core.report import read_history  # (reads roll_core.tracking: kept off this module's import)

    return no_outcome(read_history(Path(folder) / "metrics.jsonl"))
