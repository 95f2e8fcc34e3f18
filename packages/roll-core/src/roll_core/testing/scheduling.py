"""Helpers for tests that drive a `RolloutScheduler` (roll_core.scheduling.scheduler) by hand, in place of the
asynchronous driver's thread (roll_core.scheduling.driver). No engine, no pytest.

Contract: `fill_and_submit(sched, ids)` does what the driver's thread does before it submits: it starts groups up to
the scheduler's budget and registers every pending sample as submitted, under a new request id; it returns those ids
for the test to answer (`sched.on_result`), abort or lose.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from roll_core.scheduling.scheduler import RolloutScheduler

__all__ = ["fill_and_submit"]


def fill_and_submit(sched: RolloutScheduler, ids: Iterator[int], prompt_ids: Sequence[int] = (1, 2, 3)) -> list[str]:
    """Start groups of `prompt_ids` up to `sched`'s budget (payload: `"p<n>"`, n drawn from `ids`) and submit every
    pending sample as request `"r<n>"` (n drawn from `ids`); returns the new request ids in submission order."""
    while sched.capacity() > 0:
        sched.start(f"p{next(ids)}", list(prompt_ids))
    out = []
    for sample, _prompt, _remaining in list(sched.pending()):
        rid = f"r{next(ids)}"
        sched.submitted(sample, rid)
        out.append(rid)
    return out
