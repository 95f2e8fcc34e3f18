"""What `RolloutScheduler.finish_update` (roll_core.scheduling.scheduler) does with the groups the new version makes
stale (the scheduler's module docstring: staleness bound). Kept apart so that the scheduler stays one readable
module; these change the scheduler's books through its own helpers (`_drop`, `_remove`, `_admit`).

Contract (at the new version, in start order):
- A stale group that generated nothing and has no request running (`unused`: its data came during the update that
  ends, or every request of its was aborted before its first token) holds no old token: it is admitted again at
  the new version (`readmitted_groups`), in place when it is among the newest groups (`readmit_unused`), else as a
  new group last in start order (below).
- Orders "start" and "deadline": every other stale group, running or complete, is restarted (`restarted_groups`):
  taken out (`_remove`: its generated tokens counted in `stale_tokens`, its running requests returned to abort,
  their late results counted there too) and started again at the new version as a new group (a new gid, last in
  start order) with the same payload, prompt and pictures, every sample from scratch, on the budget it held. Its
  prompt is not lost from the epoch (a checkpoint lists it as pending); `stale_groups` does not count it. A prompt
  restarted MAX_RESTARTS times and stale again is dropped instead (`stale_groups` and `dropped_restarts`, warned
  once): a group that never completes within the staleness bound (batches short every version, a generation longer
  than k + 1 versions) would otherwise hold its budget and burn compute for ever.
- Order "ready": a stale running group is dropped (`stale_groups`, its prompt skipped: the order drops long
  groups by design; restarted, a group longer than k + 1 versions of generation would restart for ever on its
  budget); a stale complete one is dropped at `take`.
- Admission versions stay in start order (`_slow`, order "deadline"'s reservations and `untake` rely on it): the
  groups kept are older than the new version, those readmitted in place are the newest, the restarted ones follow.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from roll_core.scheduling.scheduler import GroupState, RolloutScheduler

log = logging.getLogger(__name__)

#: Restarts of one prompt as stale before it is dropped (`stale_groups`) instead (module docstring).
MAX_RESTARTS = 3


def retire_stale(sched: RolloutScheduler) -> list[str]:
    """Readmit, restart or drop the groups stale at the scheduler's (new) version (module docstring); returns the
    requests to abort (their results are ignored)."""
    restart = sched.order != "ready"
    doomed: list[str] = []
    removed: list[GroupState] = []  # to start again at the new version, after the groups readmitted in place
    for g in list(sched.groups.values()):  # first the stale groups that generated, run or finished
        if sched._stale(g) and not unused(g) and (restart or not g.done):
            doomed += sched._remove(g) if restart else sched._drop(g)
            removed.append(g)
    readmit_unused(sched)
    for g in list(sched.groups.values()):  # an unused one that could not be readmitted in place (a newer group ran)
        if not g.done and sched._stale(g):
            doomed += sched._remove(g) if restart else sched._drop(g)
            removed.append(g)
    if restart:
        for g in sorted(removed, key=lambda g: g.gid):  # in their start order, after every group kept
            fresh = unused(g)
            if not fresh and g.restarts >= MAX_RESTARTS:  # it never completes in time: its budget draws a new prompt
                sched.counters["stale_groups"] += 1
                sched.counters["dropped_restarts"] += 1
                if sched.counters["dropped_restarts"] == 1:
                    log.warning(
                        "a prompt was restarted %d times as stale and is dropped (counted in stale_groups): its "
                        "group does not complete within the staleness bound (raise pipeline.async_ratio, or shorten "
                        "generations)",
                        MAX_RESTARTS,
                    )
                continue
            sched._budget_used += 1  # the budget `_remove` gave back: the group keeps it
            sched.counters["readmitted_groups" if fresh else "restarted_groups"] += 1
            again = sched._admit(g.payload, g.prompt_ids, g.mm)
            again.restarts = g.restarts + (0 if fresh else 1)
    return doomed


def unused(g: GroupState) -> bool:
    """No sample of `g` generated a token, finished, runs a request or waits for its environment."""
    return not any(s.request_id is not None or s.finish is not None or s.awaiting_env or s.tokens for s in g.samples)


def readmit_unused(sched: RolloutScheduler) -> None:
    """Stale groups that generated nothing and have no request running (their data came during the update that
    ends, with async_ratio 0; or every request of theirs was aborted before its first token) are admitted again at
    the new version in place (counted in `readmitted_groups`): no token of theirs is old, so none is stale. Dropped,
    their prompts were lost from the epoch (the data position is past them) for a version they never used. Only
    among the newest unused groups (back to the first that generated or runs), and every unused group after a
    readmitted one too, so admission versions stay in start order."""
    suffix: list[GroupState] = []
    for g in reversed(sched.groups.values()):
        if not unused(g):
            break
        suffix.append(g)
    suffix.reverse()
    first = next((i for i, g in enumerate(suffix) if sched._stale(g)), None)
    if first is None:
        return
    for g in suffix[first:]:
        g.start_version = sched.version
        for smp in g.samples:
            smp.submitted_version = sched.version
        sched.counters["readmitted_groups"] += 1
