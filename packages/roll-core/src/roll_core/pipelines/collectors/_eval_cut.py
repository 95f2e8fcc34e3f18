"""The `pipeline.eval_size` cut of a task's held-out problems, and its count in the run's data counts.

Contract: a collector that samples its task's held-out problems (`task.eval_set()`) evaluates the first
`pipeline.eval_size` of them (`first_eval_size`); the problems beyond are neither trained on nor evaluated, and
`with_eval_cut` adds them to the run's `unused_held_out` (summary) and so to `data/unused_held_out` (every trained
step, `data_metrics`), on top of what the counted source reports itself (a task's hash split beyond env.eval_size;
roll_core.interfaces.tasks.DataCounts). A cut of 0 leaves the counts as the source gives them (no
`unused_held_out` is added where the source has none). The RLVR collectors (prompts.py) and the post-training ones
(sft, dpo, distill_offline: their task's held-out problems, sampled for `eval/accuracy`) share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from roll_core.interfaces.tasks import data_counts

T = TypeVar("T")


def first_eval_size(held: Sequence[T], eval_size: int) -> tuple[Sequence[T], int]:
    """The held-out problems a run evaluates, the first `eval_size` of `held` (a slice of it, same type), and how
    many it leaves out (`len(held) - eval_size`, 0 when `held` is no longer)."""
    if eval_size < 0:  # a negative slice would drop problems from the end, silently
        raise ValueError(f"pipeline.eval_size must be >= 0, got {eval_size}")
    kept = held[:eval_size]
    return kept, len(held) - len(kept)


def with_eval_cut(source: Any, cut: int) -> dict[str, Any]:
    """`data_counts(source)` (a task, or a post-training collector's `PostTrainData`) with `cut` held-out problems
    beyond pipeline.eval_size added to its `unused_held_out` (set to `cut` where the source counts none)."""
    out = data_counts(source)
    if cut < 0:
        raise ValueError(f"a count of held-out problems left out must be >= 0, got {cut}")
    if cut:
        out["unused_held_out"] = out.get("unused_held_out", 0) + int(cut)
    return out
