"""What `AsyncRollout`'s waits say when they time out (roll_core.scheduling.driver): a `take` that got fewer groups than
it asked for within `timeout_s`, an update or shrink whose submits never returned, a `close` that gave up on a thread
(`warn_stuck`: what it does and where) or on the driver's lock (`warn_lock_held`: who holds it), a `held` that gave
up on the data thread's draw (`held_timeout`), aborted requests forgotten after `abort_timeout_s` (`warn_lost` once
per version, `book_warning`; `warn_unwarned`); the errors a request's failure (`engine_failure`) or the engine's
refusal (`idle_refusal`) stops the rollout with; and the list of running requests with their ages that the agentic
collector's batch timeout shares (`running_aged`). Kept apart from the driver so that it stays one readable module;
these read the driver's state with its lock held (`warn_lock_held`, `warn_stuck`: without it, the close gave up on
it) and change nothing but the record of what was warned about (`book_warning`)."""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roll_core.scheduling.driver import AsyncRollout
    from roll_core.scheduling.scheduler import SampleState

log = logging.getLogger("roll_core.scheduling.driver")  # the driver's warnings, under its logger


def take_timeout(driver: AsyncRollout, got: int, n: int) -> TimeoutError:
    """The error of a `take` that got `got` of `n` groups within `timeout_s` (lock held): the config key that sets
    the bound, the unfinished groups (their samples left), the requests running, oldest first with how long each has
    run, and why: groups that never started for lack of budget (pipeline.async_ratio bounds it), a data source whose
    `next_group` does not return (named, with how long it has blocked), requests running without finishing (the
    engine), submits that do not return, samples no request carries (paused, or every engine shrunk away)."""
    sched = driver.sched
    waiting = [g for g in sched.groups.values() if not g.done]
    groups = ", ".join(f"{g.gid} ({len(g.samples) - g.finished} of {len(g.samples)} left)" for g in waiting[:5])
    running = list(driver._handles)
    now = time.monotonic()
    why = []
    # Groups that exist (running, or complete and not yet taken) are all a take can still get; past them, only
    # groups the budget lets start, and with none left they start only after the next weight update.
    drawing = driver._drawing_since
    # The group being drawn has its budget already (reserved): it starts once next_group returns.
    never = n - got - len(waiting) - sched.complete() - (drawing is not None)
    if never > 0 and sched.capacity() == 0:
        why.append(
            f"{never} group(s) never started for lack of budget: the scheduler's budget (pipeline.async_ratio="
            f"{sched.k}: at most {sched.k} + 1 batches of {sched.batch_groups} groups ahead of the trainer) is all "
            f"started at version {sched.version}, and no group starts before the next weight update (take at most a "
            "batch per version, or raise pipeline.async_ratio)"
        )
    if drawing is not None:
        why.append(
            f"the data source {source_name(driver.next_group)} has not returned a group for {now - drawing:.1f} s "
            "(its next_group blocks: a slow or stuck dataloader, an environment reset?)"
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


def engine_failure(driver: AsyncRollout, rid: str, exc: BaseException) -> RuntimeError:
    """The error a live request's failure stops the rollout with (lock held): it names the request, its group and
    sample."""
    sample = driver.sched.by_request.get(rid)
    where = f" (group {sample.group.gid}, sample {sample.index})" if sample is not None else ""
    return RuntimeError(f"request {rid}{where} failed in the inference engine: {type(exc).__name__}: {exc}")


def idle_refusal(rid: str, sample: SampleState, n: int, max_idle_aborts: int) -> RuntimeError:
    """The error of a request the engine aborted `n` (= `max_idle_aborts`) times in a row without a token: a
    refusal (the driver's module docstring)."""
    return RuntimeError(
        f"the engine aborted request {rid} (group {sample.group.gid} sample {sample.index}, "
        f"{len(sample.group.prompt_ids) + len(sample.tokens)} tokens of prompt and prefix) {n} times in a "
        "row without generating a token: it refuses the request (SGLang aborts a prompt longer than it "
        "accepts, e.g. more than its KV cache holds: lower model.max_prompt_length or give it more memory; "
        f"an engine that only pauses that often: raise pipeline.max_idle_aborts, now {max_idle_aborts})"
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


def held_timeout(driver: AsyncRollout, bound: float, blocked_s: float | None) -> TimeoutError:
    """The error of a `held` that waited `bound` s for the data thread's draw (`blocked_s`: how long its
    `next_group` has not returned; None: none is under way, another `held` holds the data lock)."""
    if blocked_s is None:
        why = "no draw is under way: another held() holds the data lock"
    else:
        why = (
            f"the data source {source_name(driver.next_group)} has not returned a group for {blocked_s:.1f} s (its "
            "next_group blocks: a slow or stuck dataloader, an environment reset?)"
        )
    return TimeoutError(
        f"async rollout: held() gave up after {bound:g} s (pipeline.async_batch_timeout_s) waiting for the data "
        f"thread: {why}; a checkpoint reads the data position with the groups started, so not during a draw"
    )


def source_name(next_group: Callable[..., Any]) -> str:
    """The data source as a timeout names it: the callable's qualified name (a bound method's class and name)."""
    return getattr(next_group, "__qualname__", None) or repr(next_group)


def submit_hang(driver: AsyncRollout, among: Iterable[str] | None = None) -> str:
    """What a wait that timed out adds about submits under way (lock held; empty if none), of the requests `among`
    when given (a shrink's: those of the engines it removes): the engine's `submit_request` has not returned, since
    when."""
    under_way = driver._submitting if among is None else driver._submitting.intersection(among)
    if not under_way:
        return ""
    rids = sorted(under_way, key=lambda rid: driver._since.get(rid, 0.0))
    now = time.monotonic()
    age = now - driver._since.get(rids[0], now)
    return (
        f"; {len(rids)} request(s) ({', '.join(rids[:5])}{' ...' if len(rids) > 5 else ''}) still being submitted, "
        f"the oldest for {age:.1f} s (the engine's submit_request does not return)"
    )


def warn_stuck(driver: AsyncRollout, what: str, thread: threading.Thread | None = None) -> None:
    """The warning of a `close` that gave up on a thread of the driver after `close_timeout_s` (default: the
    rollout's thread): what it does and where. The data thread's is what it waits for: a draw (`next_group`, named,
    with how long it has not returned) or, when none is under way, what `_driver_data.feed` says it waits for (a
    lock, budget)."""
    feeder = thread is not None and thread is not driver._thread
    thread = driver._thread if thread is None else thread
    log.warning(
        "async rollout: thread %r %s %gs after close() (left running, a daemon): %s; stuck in %s (an engine call "
        "or next_group that does not return?)",
        thread.name if thread is not None else "roll-async-rollout",
        what,
        driver.close_timeout_s,
        _data_doing(driver) if feeder else driver._doing,
        _where(thread),
    )


def warn_lock_held(driver: AsyncRollout) -> None:
    """The warning of a `close` that could not get the driver's lock within `close_timeout_s`: who holds it (the
    lock knows: `_driver_lock.OwnedLock`), what it does and where; when it let go just as close gave up (none holds
    it now), a caller of `held()` or the rollout thread (what holds the lock for long)."""
    owner = driver._lock.owner
    if owner is None:
        holder, doing = "a caller of held() or the rollout thread (it let go as close gave up)", ""
    elif owner is driver._thread:
        holder, doing = f"the rollout thread {owner.name!r}", f": {driver._doing}; stuck in {_where(owner)}"
    elif owner is driver._feeder:
        holder, doing = f"the data thread {owner.name!r}", f": {_data_doing(driver)}; stuck in {_where(owner)}"
    else:
        what = "a caller of held() (a checkpoint reading the groups?)" if owner is driver._held_by else "a caller"
        holder, doing = f"thread {owner.name!r}", f", {what}: stuck in {_where(owner)}"
    log.warning(
        "async rollout: close() could not get the driver's lock within %gs: %s holds it%s. The driver is closed "
        "without it (the rollout thread aborts its running requests once it gets the lock)",
        driver.close_timeout_s,
        holder,
        doing,
    )


def _data_doing(driver: AsyncRollout) -> str:
    """What the data thread does now, for `warn_stuck`: drawing a group (since when), else its own account."""
    since = driver._drawing_since
    if since is not None:
        return (
            f"drawing a group: the data source {source_name(driver.next_group)} has not returned for "
            f"{time.monotonic() - since:.1f} s"
        )
    return driver._data_doing


def _where(thread: threading.Thread | None) -> str:
    """The innermost frames of `thread`, for the warning of a thread that outlived `close`."""
    frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident is not None else None
    if frame is None:
        return "(its stack is gone)"
    return " <- ".join(
        f"{fs.name} ({fs.filename.rsplit('/', 1)[-1]}:{fs.lineno})"
        for fs in traceback.extract_stack(frame, limit=4)[::-1]
    )


def book_warning(driver: AsyncRollout, lost: dict[str, list[str]]) -> int | None:
    """One warning per version (lock held; it books which version was warned about, and the losses after its
    warning): the version to warn about now (`warn_lost`) if these are its first losses; later ones are summed up at
    the next `finish_update` (or `close`: `warn_unwarned`)."""
    if not any(lost.values()):
        return None
    version = driver.sched.version
    if driver._warned_version != version:
        driver._warned_version = version
        return version
    for cause, rids in lost.items():
        if rids:
            driver._unwarned[cause] = driver._unwarned.get(cause, 0) + len(rids)
    return None


def warn_lost(driver: AsyncRollout, version: int, lost: dict[str, list[str]], errors: list[BaseException]) -> None:
    """The warning about the first aborted requests lost at `version` (by cause: no result within
    `abort_timeout_s`, or a result that raised, `errors` theirs)."""
    what = []
    if lost["unanswered_aborts"]:
        rids = lost["unanswered_aborts"]
        what.append(f"{len(rids)} ({', '.join(rids[:5])}) brought no result within {driver.abort_timeout_s} s")
    if lost["failed_aborts"]:
        rids = lost["failed_aborts"]
        what.append(f"{len(rids)} ({', '.join(rids[:5])}) raised {type(errors[0]).__name__}: {errors[0]}")
    log.warning(
        "async rollout: aborted requests lost at version %d: %s; forgotten, their samples resume with their "
        "earlier prefixes (an engine restart or a lost worker?)",
        version,
        "; ".join(what),
    )


def warn_unwarned(unwarned: dict[str, int], version: int) -> None:
    """The summary of the losses at `version` after its first warning (at the update that ends it, or close)."""
    if unwarned:
        log.warning(
            "async rollout: %d more aborted request(s) lost at version %d (%s): forgotten, their samples resume "
            "with their earlier prefixes",
            sum(unwarned.values()),
            version,
            ", ".join(f"async/{cause} {n}" for cause, n in sorted(unwarned.items())),
        )
