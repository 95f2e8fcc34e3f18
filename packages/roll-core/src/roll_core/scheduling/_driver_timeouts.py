"""What `AsyncRollout`'s waits say when they time out (roll_core.scheduling.driver): a `take` that got fewer groups
than it asked for within `timeout_s`, an update or shrink whose submits never returned; and the list of running
requests with their ages that the agentic collector's batch timeout shares (`running_aged`). Kept apart from the
driver so that it stays one readable module; these read the driver's state with its lock held and change nothing."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from roll_core.scheduling.driver import AsyncRollout


def take_timeout(driver: AsyncRollout, got: int, n: int) -> TimeoutError:
    """The error of a `take` that got `got` of `n` groups within `timeout_s` (lock held): the config key that sets
    the bound, the unfinished groups (their samples left), the requests running, oldest first with how long each has
    run, and why: groups that never started for lack of budget (pipeline.async_ratio bounds it), requests running
    without finishing (the engine), submits that do not return, samples no request carries (paused, or every engine
    shrunk away)."""
    sched = driver.sched
    waiting = [g for g in sched.groups.values() if not g.done]
    groups = ", ".join(f"{g.gid} ({len(g.samples) - g.finished} of {len(g.samples)} left)" for g in waiting[:5])
    running = list(driver._handles)
    now = time.monotonic()
    why = []
    # Groups that exist (running, or complete and not yet taken) are all a take can still get; past them, only
    # groups the budget lets start, and with none left they start only after the next weight update.
    never = n - got - len(waiting) - sched.complete()
    if never > 0 and sched.capacity() == 0:
        why.append(
            f"{never} group(s) never started for lack of budget: the scheduler's budget (pipeline.async_ratio="
            f"{sched.k}: at most {sched.k} + 1 batches of {sched.batch_groups} groups ahead of the trainer) is all "
            f"started at version {sched.version}, and no group starts before the next weight update (take at most a "
            "batch per version, or raise pipeline.async_ratio)"
        )
    if running:
        why.append("requests running without finishing (a hung or slow inference engine?)")
    if driver._submitting:
        why.append(submit_hang(driver)[2:])
    elif not running and any(True for _ in sched.pending()):
        why.append("samples waiting for a request (the driver paused for a weight update, or every engine shrunk)")
    return TimeoutError(
        f"async rollout: {got} of {n} groups complete after {driver.timeout_s}s (pipeline.async_batch_timeout_s): "
        f"{len(waiting)} group(s) unfinished: {groups or 'none'}{' ...' if len(waiting) > 5 else ''}; "
        f"{running_aged({rid: driver._since.get(rid, now) for rid in running}, 'request(s)', now)}"
        f"{''.join(f'; {w}' for w in why)}"
    )


def running_aged(since: Mapping[str, float], noun: str, now: float | None = None) -> str:
    """`N <noun> running (oldest first, time since submitted): a (3.0 s), b (1.2 s)` for the requests in `since`
    (request id -> `time.monotonic()` when submitted), at most five named (then ` ...`); `0 <noun> running: none`.
    How long each has run tells a hung request (one the engine never answers and nothing aborts: only a batch
    timeout bounds it) from a batch that is merely slow."""
    now = time.monotonic() if now is None else now
    # Stable: requests submitted at the same moment keep their order (the driver's is submission order).
    oldest = sorted(since, key=lambda rid: since[rid])
    aged = ", ".join(f"{rid} ({now - since[rid]:.1f} s)" for rid in oldest[:5])
    return (
        f"{len(oldest)} {noun} running{' (oldest first, time since submitted)' if oldest else ''}: {aged or 'none'}"
        f"{' ...' if len(oldest) > 5 else ''}"
    )


def submit_hang(driver: AsyncRollout) -> str:
    """What a wait that timed out adds about submits under way (lock held; empty if none): the engine's
    `submit_request` has not returned, since when."""
    if not driver._submitting:
        return ""
    rids = sorted(driver._submitting, key=lambda rid: driver._since.get(rid, 0.0))
    now = time.monotonic()
    age = now - driver._since.get(rids[0], now)
    return (
        f"; {len(rids)} request(s) ({', '.join(rids[:5])}{' ...' if len(rids) > 5 else ''}) still being submitted, "
        f"the oldest for {age:.1f} s (the engine's submit_request does not return)"
    )
