"""The `pipeline.eval_size` cut of a task's held-out problems, and its count in the run's data counts.

Contract: a collector that samples its task's held-out problems (`task.eval_set()`) evaluates the first
`pipeline.eval_size` of them (`first_eval_size`); the problems beyond are neither trained on nor evaluated, and
`with_eval_cut` adds them to the run's `unused_held_out` (summary) and so to `data/unused_held_out` (every trained
step, `data_metrics`), on top of what the counted source reports itself (a task's hash split beyond env.eval_size;
roll_core.interfaces.tasks.DataCounts). A cut of 0 leaves the counts as the source gives them (no
`unused_held_out` is added where the source has none). The RLVR collectors (prompts.py) and the post-training ones
(sft, dpo, distill_offline: their task's held-out problems, sampled for `eval/accuracy`) share it.
Held-out problems of several domains (their `domain`: a multi-domain task interleaves them, so a prefix keeps every
domain once it is at least as long as the domains are many): a cut that keeps some domains and leaves others out
entirely is a warning naming them and the `pipeline.eval_size` that evaluates every domain (their
`eval/<d>/accuracy` never appeared and `eval/accuracy` covered the others only, unsaid).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from roll_core.interfaces.tasks import data_counts

log = logging.getLogger(__name__)

T = TypeVar("T")


def first_eval_size(held: Sequence[T], eval_size: int, *, evaluates: bool = True) -> tuple[Sequence[T], int]:
    """The held-out problems a run evaluates, the first `eval_size` of `held` (a slice of it, same type), and how
    many it leaves out (`len(held) - eval_size`, 0 when `held` is no longer). `evaluates`: whether the run
    evaluates them at all (pipeline.eval_every > 0); a cut leaving whole domains out is a warning then (see the
    module docstring)."""
    if eval_size < 0:  # a negative slice would drop problems from the end, silently
        raise ValueError(f"pipeline.eval_size must be >= 0, got {eval_size}")
    kept = held[:eval_size]
    if evaluates and len(kept):  # (an empty cut evaluates nothing: the collectors' own checks say so)
        _warn_dropped_domains(held, kept, eval_size)
    return kept, len(held) - len(kept)


def _warn_dropped_domains(held: Sequence[Any], kept: Sequence[Any], eval_size: int) -> None:
    first: dict[str, int] = {}  # each domain -> the place of its first held-out problem
    for i, p in enumerate(held):
        d = getattr(p, "domain", None)
        if d is not None:
            first.setdefault(str(d), i)
    if len(first) < 2:
        return
    evaluated = {str(getattr(p, "domain", None)) for p in kept}
    dropped = [d for d in first if d not in evaluated]
    if dropped:
        log.warning(
            "pipeline.eval_size=%d evaluates held-out problems of domain(s) %s only: %s are not evaluated (no "
            "eval/<d>/accuracy; eval/accuracy covers the others); pipeline.eval_size=%d evaluates every domain",
            eval_size,
            [d for d in first if d in evaluated],
            dropped,
            max(first.values()) + 1,
        )


def with_eval_cut(source: Any, cut: int) -> dict[str, Any]:
    """`data_counts(source)` (a task, or a post-training collector's `PostTrainData`) with `cut` held-out problems
    beyond pipeline.eval_size added to its `unused_held_out` (set to `cut` where the source counts none)."""
    out = data_counts(source)
    if cut < 0:
        raise ValueError(f"a count of held-out problems left out must be >= 0, got {cut}")
    if cut:
        out["unused_held_out"] = out.get("unused_held_out", 0) + int(cut)
    return out
