"""The asynchronous rollout driver: `RolloutScheduler` over a real inference group, in background threads.

Contract: after `start()`, a daemon data thread keeps the scheduler's budget filled (new groups from `next_group`:
(payload, prompt ids) or (payload, prompt ids, the prompt's pictures as MMInputs)), and a daemon rollout thread submits
every pending sample as one request (`infer.submit_request`, with the group's pictures) and records finished requests.
The trainer's thread calls `take(n)` (blocks until n complete groups within the staleness bound exist, or `timeout_s`
passes; a `take` that raises gives the groups it had taken back to the scheduler, for the next `take`), and brackets
every weight sync with `begin_update()` / `finish_update()`: with partial rollout the running requests are aborted first
and their prefixes resumed under the new weights; the requests of groups that became too stale are aborted (the
scheduler restarts those groups from scratch at the new version, or drops them in order "ready"). A failure in a thread
(engine error, a `next_group` that raises or returns something else than its contract says:
roll_core.scheduling._driver_data) is raised in the trainer's next call, never swallowed; the first failure is the one
kept (the other thread's, after it, is logged only), and the running requests are aborted at once (they generated for
nobody until `close`). A `next_group` or a `submit_request` that fails after `close` (its data or engine torn down by
the shutdown) is expected: logged in one line, the driver stays closed (later calls say closed, not failed). Every
request is aborted once (`_mark_aborting`: an update's, a shrink's, close's), never again by a later one. An abort the
engine made on its own resumes the sample (preemption), but `max_idle_aborts` (pipeline.max_idle_aborts, default
`roll_core.idle_aborts.MAX_IDLE_ABORTS`) of them in a row for one sample within one version, none with a token, are a
refusal (SGLang aborts a prompt longer than its KV cache holds): the thread fails naming the request, instead of
resubmitting it in a busy loop while the trainer waits out `timeout_s`. `close()` aborts what runs and stops the threads
(one still alive after `close_timeout_s` is left, a daemon, with a warning naming what it was doing and where; a close
that cannot get the driver's lock names who holds it: a caller inside `held()`, the rollout or the data thread; both
threads joined against one deadline: the data thread blocked in `next_group`, or waiting for a lock, submits nothing
after close); a `take` (or update, shrink) waiting then, or called later, raises at once. The engine and the data source
are called without the driver's lock, and `next_group` on a thread of its own, so an engine call that blocks
(`submit_request`) never blocks `close`, nor `take`'s timeout, and a `next_group` that blocks (a slow dataloader, an
environment reset) blocks none of `close`, `take`'s timeout, `begin_update`, `shrink`, nor the collection of the results
they wait for (a group whose data comes during an update is pending until `finish_update`, and starts at the new
version: the scheduler's `readmitted_groups`; only `held`, which reads the data position with the groups, waits for the
draw, at most `timeout_s`: past it a TimeoutError names the data source). A `take` that times out says why: groups that
never started for lack of budget (pipeline.async_ratio), the data source blocked in `next_group` (named, with for how
long), requests running without finishing (the engine: the oldest named first, with how long each has run), submits that
do not return, or samples no request carries.

Requests that never return. A request this driver aborted (partial rollout at `begin_update`, a stale group's at
`finish_update`, one moved by `shrink` / `expand`) normally brings its partial result within moments. If its handle
has not completed `abort_timeout_s` (60 s) after the abort (the engine restarted, its worker died, the abort was
lost), or its `result()` raises, the driver forgets it and reports it to `RolloutScheduler.lost`: a live sample
resumes with its earlier prefix kept (what the lost request generated is gone), a stale group's id is forgotten;
counted in `async/unanswered_aborts` and `async/failed_aborts` (and the scheduler's `async/lost_requests`; one the
scheduler already forgot after `dropped_ttl` versions is in its `async/pruned_requests` only), with one warning per
version (the first loss at once, the rest summed up at the next `finish_update`, or at `close` for the last
version). So neither the handles nor the scheduler's ids of such requests are kept for good, and a weight update
waiting on an abort goes on after the bound instead of failing the run. A request that was NOT aborted and
whose `result()` raises is an engine failure: the thread stops and the trainer's next call (`take`, `begin_update`,
...) raises a RuntimeError naming the request, its group and sample, chained to the engine's error; it is never
retried or dropped silently (a batch waiting for that sample would otherwise wait out `timeout_s`, an hour in a
run). A request that was NOT aborted and whose handle never completes has no bound of its own (a long generation is
legitimate; only the engine can tell it from a hung one): the batch waiting for it is bounded by `timeout_s`, whose
error names the oldest running requests with how long each has run.

The same code runs on `cluster=local` (engines in this process: generation and training share its cores) and on
Ray (engines in their own processes: real overlap).

Partial-GPU mode (ROLL's partial_gpu_mode): with an `EnginePool` (roll_core.scheduling.pool) the driver places every
request on an engine itself (`infer.submit_request(request, rank=engine)`) and the set of engines can change while
requests run: `shrink(engines)` (before the trainer takes those devices back) aborts their requests and waits until
the partial results are recorded (a submit under way to one of those engines included; one to an engine that stays
is not waited for), so the samples resume on the engines that stay with their prefixes kept;
`expand(engines)` (their engines woken at the current weights) routes to them again and moves the newest requests of
the loaded engines onto them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from roll_core.idle_aborts import MAX_IDLE_ABORTS, check_max_idle_aborts
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.scheduling._driver_data import feed
from roll_core.scheduling._driver_lock import OwnedLock
from roll_core.scheduling._driver_timeouts import (
    book_warning,
    engine_failure,
    held_timeout,
    idle_refusal,
    submit_hang,
    take_timeout,
    warn_lock_held,
    warn_lost,
    warn_stuck,
    warn_unwarned,
)
from roll_core.scheduling.pool import EnginePool
from roll_core.scheduling.scheduler import GroupState, RolloutScheduler, SampleState

log = logging.getLogger(__name__)


class AsyncRollout:
    """Generates groups ahead of the trainer (see the module docstring)."""

    #: How long `close` waits for the thread to stop; past it the thread is left (a daemon) and a warning says where
    #: it was stuck.
    close_timeout_s: float = 30.0

    def __init__(
        self,
        infer: Any,
        scheduler: RolloutScheduler,
        next_group: Callable[[], tuple[Any, ...]],
        params: SamplingParams,
        *,
        poll_s: float = 0.002,
        timeout_s: float = 3600.0,
        pool: EnginePool | None = None,
        max_idle_aborts: int = MAX_IDLE_ABORTS,
        abort_timeout_s: float = 60.0,
    ) -> None:
        """`abort_timeout_s`: how long an aborted request may take to bring its result before it is forgotten as
        lost (module docstring); also what `begin_update` and `shrink` wait for their aborts (plus a margin).
        `max_idle_aborts`: the engine's own aborts of one sample in a row, none with a token, that fail the rollout
        as a refusal (module docstring)."""
        if not abort_timeout_s > 0:
            raise ValueError(f"abort_timeout_s={abort_timeout_s} must be > 0 (seconds an abort may take to return)")
        self.infer, self.sched, self.next_group, self.params = infer, scheduler, next_group, params
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.pool = pool  # None: the infer group routes each request itself
        self._lock = OwnedLock()  # knows its holder: a close that cannot get it names it (`warn_lock_held`)
        self._cv = threading.Condition(self._lock)
        self._held_by: threading.Thread | None = None  # the caller inside `held()`, if any
        self._handles: dict[str, Any] = {}
        # Requests handed to the engine (or being handed) -> when: a take that times out says how long the oldest
        # ran. Removed with their handles.
        self._since: dict[str, float] = {}
        # Requests built and booked in the scheduler whose `submit_request` has not returned: the engine is called
        # without the lock (a submit that blocks must not block `close`, `take`'s timeout, an update).
        self._submitting: set[str] = set()
        # Held by the data thread while it draws a group (`next_group`, without `_cv`) and starts it; `held` takes
        # it first (lock order: `_data_lock`, then `_cv`; no thread waits for it holding `_cv`).
        self._data_lock = threading.RLock()
        self._drawing_since: float | None = None  # when the `next_group` under way was called (None: none is)
        self._paused = False
        self._stopped = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._feeder: threading.Thread | None = None  # the data thread (`_feed`)
        self._n = 0
        self._last: dict[str, int] = {}
        self.max_idle_aborts = check_max_idle_aborts(max_idle_aborts)
        self.abort_timeout_s = abort_timeout_s
        # Requests this driver aborted, result not yet collected -> when first aborted (insertion order is time
        # order: `_mark_aborting` keeps the first abort's time, so the expired ones are at the front).
        self._aborting: dict[str, float] = {}
        self._counters = {"unanswered_aborts": 0, "failed_aborts": 0}  # requests forgotten as lost, by cause
        self._warned_version = -1  # the version whose first loss was warned about (one warning per version)
        self._unwarned: dict[str, int] = {}  # losses since that warning, by cause: summed up at finish_update
        self._idle_aborts: dict[tuple[int, int], int] = {}  # sample -> engine aborts without a token, this version
        self._doing = "not started"  # what the thread does now, coarsely (a close that times out names it)
        self._data_doing = "not started"  # what the data thread waits for when not drawing (`_driver_data.feed`)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background threads (once; never after `close`): the rollout's, and the data's (`_feed`)."""
        # Under the lock, with the closed state checked: a `close` from another thread (shutdown) between the
        # thread's creation and its start joined a thread not yet started (RuntimeError), and a `take` after `close`
        # started a thread nothing would join.
        with self._cv:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="roll-async-rollout", daemon=True)
                self._thread.start()
                self._feeder = threading.Thread(target=self._feed, name="roll-async-data", daemon=True)
                self._feeder.start()

    def close(self) -> None:
        """Abort what runs and stop the threads (module docstring); later calls raise that the driver is closed."""
        # Bounded: a close that waited for the lock for ever hung the shutdown (the thread held it in `next_group`,
        # which it now calls without it; a caller may hold it long in `held`). Past the bound the flag is set without
        # the lock (one assignment; the thread and every waiter read it at their next poll) and the thread is left.
        if not self._cv.acquire(timeout=self.close_timeout_s):
            self._stopped = True
            warn_lock_held(self)  # names the holder: a caller inside held(), the rollout or the data thread
            return
        try:
            self._stopped = True
            running = self._mark_aborting(list(self._handles))  # (those aborted before are not aborted again)
            thread, feeder = self._thread, self._feeder  # read with the state: `start` sets them under this lock
            unwarned, self._unwarned = self._unwarned, {}
            version = self.sched.version
            self._cv.notify_all()
        finally:
            self._cv.release()
        warn_unwarned(unwarned, version)  # the losses since this version's warning: no finish_update sums them
        # A request whose submit is still under way is aborted by the thread once the engine returns its handle.
        for rid in running:
            self.infer.abort(rid)
        # One deadline for both: they were stopped together and end independently, so each has had the whole
        # `close_timeout_s` when its join gives up (the data thread's join getting "what is left" is that bound). A
        # data thread still alive then is blocked in next_group or on a lock (the warning says which); it submits
        # nothing after close, and ends when that returns.
        deadline = time.monotonic() + self.close_timeout_s
        for t in (thread, feeder):
            if t is not None:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    warn_stuck(self, "still alive", thread=t)

    # ---- the trainer's side -------------------------------------------------------------------------------
    def take(self, n: int) -> list[GroupState]:
        """n complete groups within the staleness bound, oldest first (blocks until they exist). If it raises
        (timeout, failure, close), the groups it had taken go back to the scheduler: a later `take` returns them."""
        self.start()
        deadline = time.monotonic() + self.timeout_s
        out: list[GroupState] = []
        with self._cv:
            try:
                while True:
                    self._raise()
                    out += self.sched.take(n - len(out))
                    if len(out) >= n:
                        # Taken over several waits, orders "ready" and "deadline" return later groups first.
                        return sorted(out, key=lambda g: g.gid)
                    if time.monotonic() > deadline:
                        raise take_timeout(self, len(out), n)
                    self._cv.wait(0.5)
            except BaseException:
                # Taken, never returned: lost for good (no batch trained them, yet the budget booked them as
                # trained), and a trainer that retried after a timeout waited for groups that no longer existed.
                self.sched.untake(out)
                raise

    @contextlib.contextmanager
    def held(self, timeout_s: float | None = None) -> Iterator[None]:
        """The driver's lock, held: no group starts (no `next_group` call) and no result is recorded meanwhile (a
        checkpoint reads the data position and the groups not yet trained as one state). Waits for a `next_group`
        under way (its data and its group are one state), at most `timeout_s` (default: the driver's `timeout_s`,
        a take's bound): past it a TimeoutError names the data source and how long it has blocked (a checkpoint
        that waited for it hung the run for as long, without a word).

        The body must not wait for new groups nor for results (a `take`, an update's wait, polling the scheduler
        until a group completes): it holds the lock the data thread starts groups under and the rollout thread
        records results under, so nothing it waits for can come (such a wait ends only at its own timeout). Read or
        write the state, and leave."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        if not self._data_lock.acquire(timeout=max(0.0, bound)):
            with self._cv:
                drawing = self._drawing_since
            raise held_timeout(self, bound, None if drawing is None else time.monotonic() - drawing)
        try:
            with self._cv:
                outer, self._held_by = self._held_by, threading.current_thread()
                try:
                    yield
                finally:
                    self._held_by = outer
        finally:
            self._data_lock.release()

    def discard(self, group: GroupState) -> None:
        """A taken group that will not be trained on (its budget starts a new group)."""
        with self._cv:
            self.sched.discard(group)
            self._cv.notify_all()

    def begin_update(self) -> None:
        """Before a weight sync: stop submitting; with partial rollout abort the running requests and wait until
        their partial results are recorded (they resume after `finish_update`)."""
        with self._cv:
            self._raise()
            self._paused = True
            to_abort = self.sched.begin_update()
            send = self._mark_aborting(to_abort)
        for rid in send:
            self.infer.abort(rid)
        # The thread collects them, or forgets them as lost after abort_timeout_s (the sync then goes on): this
        # wait fails only if the thread is stuck.
        wait_s = self._wait_bound()
        deadline = time.monotonic() + wait_s
        with self._cv:
            # A submit still under way would land on the weights being changed: it ends first (its request, when
            # partial rollout aborted it, is aborted by the thread then, and waited for here).
            while self._submitting or any(rid in self._handles for rid in to_abort):
                self._raise()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"async rollout: aborted requests were neither collected nor forgotten within {wait_s} s"
                        f"{submit_hang(self)}"
                    )
                self._cv.wait(0.05)

    def finish_update(self) -> None:
        """After a weight sync: bump the version, abort groups now too stale, resume generation."""
        with self._cv:
            before = list(self.sched.groups.values()) if self.pool is not None else []
            doomed = self._mark_aborting(self.sched.finish_update())
            # The homes of the samples of groups dropped as stale (or restarted: under a new gid): nothing else forgets
            # them (only a sample that finishes is forgotten), and the pool's routing table grew by them every version.
            for g in before:
                if g.gid not in self.sched.groups:
                    for smp in g.samples:
                        self.pool.forget((g.gid, smp.index))  # type: ignore[union-attr]
            self._idle_aborts.clear()  # counted per version: an engine may abort what it runs at an update
            unwarned, self._unwarned = self._unwarned, {}
            version = self.sched.version
            self._paused = False
            self._cv.notify_all()
        warn_unwarned(unwarned, version - 1)
        # A doomed request whose submit is still under way is aborted by the thread once the engine returns it.
        for rid in doomed:
            self.infer.abort(rid)

    # ---- partial-GPU mode: engines that leave and rejoin ---------------------------------------------------------
    def shrink(self, engines: list[Any], timeout_s: float | None = None) -> int:
        """Take `engines` out of the rollout (their devices are about to train): no new request goes there, their
        running requests are aborted and this waits until the partial results are recorded, or the requests are
        forgotten as lost after `abort_timeout_s` (those samples resume on the other engines). `timeout_s` (default:
        that bound plus a margin) bounds the wait. Returns how many requests were moved."""
        pool = self._need_pool()
        with self._cv:
            self._raise()
            moved = pool.shrink(engines)
            send = self._mark_aborting(moved)
        for rid in send:
            self.infer.abort(rid)
        timeout_s = self._wait_bound() if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cv:
            # Only the removed engines' requests: a submit under way to one of them is placed there (`_book_requests`
            # assigns before the submit, the pool releases it only once collected or lost), so `draining` waits for
            # it too; a submit to an engine that stays does not touch the devices taken back.
            while any(rid in self._handles for rid in moved) or pool.draining(engines):
                self._raise()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"async rollout: requests of engines {engines} did not return in {timeout_s} s"
                        f"{submit_hang(self, pool.draining(engines))}"
                    )
                self._cv.wait(0.05)
        return len(moved)

    def expand(self, engines: list[Any], *, rebalance: bool = True) -> int:
        """Route to `engines` again (woken at the current weights); with `rebalance`, the newest requests of the
        engines above the mean load are aborted and resume on them. Returns how many requests were moved."""
        pool = self._need_pool()
        with self._cv:
            self._raise()
            moved = pool.expand(engines, rebalance=rebalance)
            send = self._mark_aborting(moved)
            self._cv.notify_all()
        for rid in send:
            self.infer.abort(rid)
        return len(moved)

    def _need_pool(self) -> EnginePool:
        if self.pool is None:
            raise RuntimeError("shrink/expand need the driver built with pool=EnginePool(...) (partial-GPU mode)")
        return self.pool

    def stats(self) -> dict[str, float]:
        """Counters since the previous call (groups started, stale, discarded, requests resumed, lost) and gauges
        (`async/dropped_requests_waiting`: stale groups' aborted requests whose results have not come yet)."""
        with self._cv:
            now = {**self.sched.counters, **self._counters}
            out = {f"async/{k}": float(v - self._last.get(k, 0)) for k, v in now.items()}
            self._last = now
            out["async/dropped_requests_waiting"] = float(self.sched.dropped_requests())
            out["async/in_flight_groups"] = float(self.sched.in_flight())
            out["async/complete_groups"] = float(self.sched.complete())
            out["async/version"] = float(self.sched.version)
            return out

    def _fail(self, exc: BaseException) -> None:
        """Store a thread's failure for `_raise` and wake the waiters: the first one (a failure of the other thread
        after it, often its consequence, replaced it: the trainer's next call raised another cause than its first)."""
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def _raise(self) -> None:
        """Raise the thread's failure, or that the driver is closed (lock held): after `close` nothing generates,
        and a `take` waiting then (shutdown from another thread) waited out `timeout_s`, an hour in a run."""
        if self._error is not None:
            raise RuntimeError(f"async rollout failed: {self._error}") from self._error
        if self._stopped:
            raise RuntimeError("async rollout closed: no group completes any more")

    # ---- the background thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        left: list[str] = []
        try:
            while True:
                batch: list[tuple[str, Request, Any]] = []
                with self._cv:
                    if self._stopped or self._error is not None:
                        # What close could not abort (it gave up on the lock while a caller held it), or the data
                        # thread failed (raised by _raise): requests generating for nobody, aborted at once.
                        left = self._abandon()
                        break
                    if not self._paused:
                        batch = self._book_requests()
                if batch:
                    self._doing = "submitting requests (the engine's submit_request)"
                    self._submit(batch)
                with self._cv:
                    handles = list(self._handles.items())
                self._doing = "polling the request handles and reading the finished ones' results"
                progressed = False
                failed: dict[str, BaseException] = {}  # aborted requests whose result() raised
                for rid, h in handles:
                    if not h.done():
                        continue
                    progressed = True
                    try:
                        out = h.result()
                    except Exception as exc:  # an aborted request's: a loss; a live one's: raised
                        with self._cv:
                            if rid not in self._aborting:
                                raise engine_failure(self, rid, exc) from exc
                        failed[rid] = exc
                        continue
                    self._record(rid, out)
                # The losses are booked and the warning decided in one hold of the lock: a caller waiting for these
                # handles to go (begin_update) sees them go together with the bookkeeping, never before it.
                with self._cv:
                    failed_lost = self._lose(list(failed), "failed_aborts") if failed else []
                    lost = {"failed_aborts": failed_lost, "unanswered_aborts": self._forget_unanswered()}
                    warn = book_warning(self, lost)
                if warn is not None:
                    warn_lost(self, warn, lost, [failed[rid] for rid in failed_lost])
                if not progressed:
                    time.sleep(self.poll_s)
        except BaseException as exc:  # surfaced in the trainer's thread by _raise
            log.exception("async rollout thread failed")
            self._fail(exc)
            with self._cv:
                left = self._abandon()  # the other requests would run until close(), for nobody
        for rid in left:
            try:
                self.infer.abort(rid)
            except Exception as exc:  # (the engine may be what failed) the failure is raised already, or closed
                log.info(
                    "async rollout: abort of %s after the rollout stopped raised %s: %s", rid, type(exc).__name__, exc
                )

    def _abandon(self) -> list[str]:
        """The running requests not yet aborted, marked aborted (lock held): the rollout stopped (closed or failed),
        the caller aborts them (not those whose handle completed: a failed one's, say)."""
        return self._mark_aborting([rid for rid, h in self._handles.items() if not h.done()])

    def _record(self, rid: str, out: RequestOutput) -> None:
        """Record a collected result (takes the lock)."""
        with self._cv:
            self._handles.pop(rid, None)
            self._since.pop(rid, None)
            sample = self.sched.by_request.get(rid)
            asked = self._aborting.pop(rid, None) is not None
            if sample is not None:
                self._count_idle_abort(sample, rid, out, asked)
            self.sched.on_result(rid, list(out.token_ids), list(out.logprobs), out.finish_reason)
            if self.pool is not None:
                self.pool.release(rid)
                if sample is not None and sample.finish is not None:
                    self.pool.forget((sample.group.gid, sample.index))
            self._cv.notify_all()

    def _mark_aborting(self, rids: list[str]) -> list[str]:
        """`rids` are about to be aborted (lock held): the bound runs from the first abort of each. Returns the ones
        the caller aborts: each once, if its engine knows it (a handle); one aborted before is not aborted again, and
        one whose submit is under way is aborted by `_submit` once the engine returns its handle."""
        now = time.monotonic()
        new = [rid for rid in dict.fromkeys(rids) if rid not in self._aborting]
        for rid in new:
            self._aborting[rid] = now
        return [rid for rid in new if rid in self._handles]

    def _wait_bound(self) -> float:
        """How long a caller waits for aborts the thread collects or forgets after abort_timeout_s: that plus a
        margin for the thread's sweep (a wait past it means the thread is stuck)."""
        return self.abort_timeout_s + max(self.abort_timeout_s, 10.0)

    def _forget_unanswered(self) -> list[str]:
        """Forget the aborted requests without a result `abort_timeout_s` after their abort (lock held); returns
        those counted as lost (`_lose`). `_aborting` is in abort-time order: stop at the first one still within the
        bound."""
        cutoff = time.monotonic() - self.abort_timeout_s
        expired = []
        for rid, at in self._aborting.items():
            if at > cutoff:
                break
            expired.append(rid)
        # Collected already: nothing to forget. One whose submit is under way stays: the thread aborts it, and
        # forgets it in a later sweep, once the engine returned its handle.
        gone = [rid for rid in expired if rid not in self._handles and rid not in self._submitting]
        for rid in gone:
            del self._aborting[rid]
        # A handle that completed just now is collected by this sweep instead: its partial result is kept.
        expired = [rid for rid in expired if rid in self._handles and not self._handles[rid].done()]
        return self._lose(expired, "unanswered_aborts") if expired else []

    def _lose(self, rids: list[str], cause: str) -> list[str]:
        """Aborted requests that will bring no result (lock held): forget their handles and tell the scheduler (a
        live sample resumes with its prefix kept, on any engine: the one it ran on may be gone). Returns the ones
        counted under `cause` (and warned about): those the scheduler still waited for. A stale group's request it
        already forgot (`dropped_ttl` versions without a result) was counted and warned about there, in
        `async/pruned_requests`: one request, one count (counted here too, `async/unanswered_aborts` exceeded
        `async/lost_requests` for no extra loss)."""
        for rid in rids:
            self._handles.pop(rid, None)
            self._since.pop(rid, None)
            self._aborting.pop(rid, None)
            sample = self.sched.by_request.get(rid)
            if self.pool is not None and self.pool.engine_of(rid) is not None:
                self.pool.release(rid)
                if sample is not None:
                    self.pool.forget((sample.group.gid, sample.index))
        known = [rid for rid in rids if self.sched.expects_result(rid)]
        if known:
            self.sched.lost(known)  # one call for the sweep (it counts exactly these: `expects_result`)
        self._counters[cause] += len(known)
        self._cv.notify_all()
        return known

    def _count_idle_abort(self, sample: SampleState, rid: str, out: RequestOutput, asked: bool) -> None:
        """Count the engine's own aborts of `sample` that brought no token (lock held); too many: raise."""
        key = (sample.group.gid, sample.index)
        if out.finish_reason != "abort" or out.token_ids or asked:
            self._idle_aborts.pop(key, None)
            return
        n = self._idle_aborts[key] = self._idle_aborts.get(key, 0) + 1
        if n >= self.max_idle_aborts:
            raise idle_refusal(rid, sample, n, self.max_idle_aborts)

    def _feed(self) -> None:
        """The data thread (roll_core.scheduling._driver_data): start groups up to the budget, each drawn from
        `next_group` without the driver's lock, its budget reserved first; `held` waits for a draw under way."""
        feed(self)

    def _book_requests(self) -> list[tuple[str, Request, Any]]:
        """Book a request for every pending sample (lock held); returns them as (id, request, engine or None),
        listed in `_submitting`, for `_submit` to hand to the engine."""
        if self.pool is not None and not self.pool.active:
            return []  # every engine is shrunk away: the samples wait for an expand
        batch = []
        for sample, ids, remaining in list(self.sched.pending()):
            rid = f"async-{self._n}"
            self._n += 1
            seed = None if self.params.seed is None else (self.params.seed * 1_000_003 + self._n) % 2**62
            params = self.params.replace(max_new_tokens=max(1, remaining), seed=seed)
            self.sched.submitted(sample, rid)
            engine = None if self.pool is None else self.pool.assign(rid, key=(sample.group.gid, sample.index))
            batch.append((rid, Request(rid, ids, params, mm=sample.group.mm), engine))
            self._submitting.add(rid)
            self._since[rid] = time.monotonic()
        return batch

    def _submit(self, batch: list[tuple[str, Request, Any]]) -> None:
        """Hand `_book_requests`' requests to the engine without the lock (an engine call may block: `close`, `take`'s
        timeout and the updates must not wait on it). What happened meanwhile is caught up under the lock after
        each: a request aborted meanwhile (an update, a stale group, a shrink, close) is aborted now that the
        engine knows it; `begin_update` waits until no submit is under way (none lands on weights being changed),
        `shrink` until none to the engines it removes is. Waiters are woken once per round, at its end."""
        try:
            for rid, request, engine in batch:
                if self._stopped or self._error is not None:  # closed or failed: nothing generates any more
                    return
                handle = (
                    self.infer.submit_request(request)
                    if engine is None
                    else self.infer.submit_request(request, rank=engine)
                )
                with self._cv:  # no notify: no waiter can go on before `_submitting` is empty (`finally`)
                    self._submitting.discard(rid)
                    self._handles[rid] = handle
                    abort = self._stopped or rid in self._aborting
                    if abort:  # its abort's bound runs from now, when the engine knows it (at the end: time order)
                        self._aborting.pop(rid, None)
                        self._aborting[rid] = time.monotonic()
                if abort:
                    self.infer.abort(rid)
        except Exception as exc:
            # The failure is stored in the same hold that ends the submit (`finally`): a `begin_update` waiting for
            # the submit to end woke to an empty `_submitting` before the thread stored the error, and went on.
            with self._cv:
                closed = self._stopped and self._error is None  # the engine shuts down after close: expected
                failure = engine_failure(self, rid, exc)
                if not self._stopped and self._error is None:  # (the first failure is kept: `_fail`)
                    self._error = failure
            if closed:  # one line, the driver stays closed (later calls say closed, not failed)
                log.info("async rollout: a submit after close() (a shutdown) raised: %s", failure)
                return
            raise failure from exc
        finally:
            with self._cv:
                self._submitting.difference_update(rid for rid, _, _ in batch)
                self._cv.notify_all()
