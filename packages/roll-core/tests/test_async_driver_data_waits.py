"""AsyncRollout (roll_core.scheduling.driver) and what its waits wait for: a data source whose `next_group` blocks (a
slow dataloader, an environment reset) held the driver's lock, so `take` ignored its timeout and `begin_update` /
`shrink` waited for the data (and the results they wait for were not collected meanwhile); `shrink` waited for
submits to engines it does not remove; the lost requests of one sweep were reported to the scheduler one call per
id; the thread woke every waiter once per submitted request. Fake engines, no Ray, no fixed sleeps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from roll_core.interfaces import Request, SamplingParams
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.pool import EnginePool
from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.held_requests import HeldRequestEngine
from roll_core.testing.threads import InThread

WITHIN_S = 60  # generous: a loaded machine may take seconds to schedule a thread
HOLD_S = 3 * WITHIN_S  # how long a blocked call waits for its release at most (the test's waits end first)


class _BlockingData:
    """`next_group`: prompts [0], [1], ...; the draw of prompt `block_at` does not return until `release` is set
    (`entered` says it was called)."""

    def __init__(self, block_at: int) -> None:
        self.block_at = block_at
        self.entered, self.release = threading.Event(), threading.Event()
        self.drawn: list[int] = []
        self._prompts = iter(range(10**6))

    def next_group(self) -> tuple:
        prompt = next(self._prompts)
        self.drawn.append(prompt)
        if prompt == self.block_at:
            self.entered.set()
            self.release.wait(HOLD_S)
        return ("p", [prompt])


def _engine() -> HeldRequestEngine:
    return HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])


def _wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WITHIN_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _sched(**kwargs: object) -> RolloutScheduler:
    # (k + 1) B = 2 groups of one sample by default
    args = {"batch_groups": 1, "group_size": 1, "max_new_tokens": 4, "async_ratio": 1, **kwargs}
    return RolloutScheduler(**args)  # type: ignore[arg-type]


def test_a_take_honours_its_timeout_while_next_group_blocks_and_names_the_data_source() -> None:
    """The draw of the second group blocks. The take waited for the driver's lock next_group's caller held, past its
    timeout, for as long as the data did not come. Now the first group is generated meanwhile and taken, and a take
    for the second times out saying the data source (named) has not returned, not that the budget is used up."""
    data = _BlockingData(block_at=1)
    engine = _engine()
    driver = AsyncRollout(engine, _sched(), data.next_group, SamplingParams(max_new_tokens=4), timeout_s=0.3)
    try:
        driver.start()
        assert data.entered.wait(WITHIN_S)
        engine.wait_running(1)
        engine.serve()
        trainer = InThread(lambda: driver.take(1))
        assert trainer.join(WITHIN_S), "take waited for next_group"
        assert trainer.error is None, trainer.error
        assert [g.prompt_ids for g in trainer.result] == [[0]]
        trainer = InThread(lambda: driver.take(1))
        assert trainer.join(WITHIN_S), "take did not time out: it waited for next_group"
        assert isinstance(trainer.error, TimeoutError), trainer.error
        msg = str(trainer.error)
        assert "0 of 1 groups complete after 0.3s (pipeline.async_batch_timeout_s): 0 group(s) unfinished" in msg, msg
        assert (
            "the data source _BlockingData.next_group has not returned a group for " in msg
            and "s (its next_group blocks: a slow or stuck dataloader, an environment reset?)" in msg
        ), msg
        assert "lack of budget" not in msg, msg  # the blocked group has its budget: it starts once the data comes
        data.release.set()
        engine.wait_running(1)
        engine.serve()
        driver.timeout_s = WITHIN_S
        assert [g.prompt_ids for g in driver.take(1)] == [[1]]
    finally:
        data.release.set()
        driver.close()
        engine.release()


def test_a_weight_update_goes_on_while_next_group_blocks_and_nothing_is_submitted_until_it_ends() -> None:
    """Partial rollout: group 0's request runs and the draw of group 1 blocks when the trainer begins a weight
    update. The update waited for next_group (the driver's lock, and the thread that collects the aborted result).
    Now it aborts the request and returns once its partial result is recorded; the data that comes during the update
    starts a group that is not submitted before `finish_update`, after which both samples run (group 0 resumed with
    its prefix)."""
    data = _BlockingData(block_at=1)
    engine = _engine()
    driver = AsyncRollout(
        engine, _sched(partial_rollout=True), data.next_group, SamplingParams(max_new_tokens=4), timeout_s=WITHIN_S
    )
    sweeps = [0]
    forget = driver._forget_unanswered

    def counted() -> list[str]:  # one per loop of the rollout thread (under the lock)
        sweeps[0] += 1
        return forget()

    driver._forget_unanswered = counted  # type: ignore[method-assign]
    try:
        driver.start()
        assert data.entered.wait(WITHIN_S)
        assert engine.wait_running(1) == ["async-0"]
        update = InThread(driver.begin_update)
        assert update.join(WITHIN_S), "begin_update waited for next_group"
        assert update.error is None, update.error
        assert engine.aborts == ["async-0"] and not driver._handles
        data.release.set()
        _wait(lambda: driver.sched.counters["started_groups"] == 2, "the group drawn during the update started")
        with driver.held():
            seen = sweeps[0]
        _wait(lambda: sweeps[0] >= seen + 2, "the rollout thread looped after the group started")
        assert [r.request_id for r in engine.requests] == ["async-0"]  # nothing submitted during the update
        driver.finish_update()
        engine.wait_running(2)
        assert sorted(r.prompt_ids for r in engine.requests[1:]) == [[0, 7], [1]]
    finally:
        data.release.set()
        driver.close()
        engine.release()


def test_a_shrink_goes_on_while_next_group_blocks() -> None:
    """Partial-GPU mode: group 0's request runs on engine 0 and the draw of group 1 blocks when the trainer shrinks
    engine 0 away. The shrink waited for next_group; now it aborts the request, returns once its partial result is
    recorded, and the sample resumes (on engine 1) with its prefix."""
    data = _BlockingData(block_at=1)
    engine = _engine()
    driver = AsyncRollout(
        engine, _sched(), data.next_group, SamplingParams(max_new_tokens=4), timeout_s=WITHIN_S, pool=EnginePool([0, 1])
    )
    try:
        driver.start()
        assert data.entered.wait(WITHIN_S)
        assert engine.wait_running(1) == ["async-0"]
        assert driver.pool is not None and driver.pool.engine_of("async-0") == 0
        shrink = InThread(lambda: driver.shrink([0]))
        assert shrink.join(WITHIN_S), "shrink waited for next_group"
        assert shrink.error is None and shrink.result == 1, shrink.error
        assert engine.wait_running(1) == ["async-1"]
        assert engine.requests[-1].prompt_ids == [0, 7] and driver.pool.engine_of("async-1") == 1
    finally:
        data.release.set()
        driver.close()
        engine.release()


def _blocking_submit(engine: HeldRequestEngine, rid: str) -> tuple[threading.Event, threading.Event]:
    entered, release = threading.Event(), threading.Event()

    def on_submit(request: Request) -> None:
        if request.request_id == rid:
            entered.set()
            release.wait(HOLD_S)

    engine.on_submit = on_submit
    return entered, release


def test_a_shrink_waits_for_a_submit_to_the_engines_it_removes_only() -> None:
    """The engine's submit of the only request (async-0, placed on engine 1: the pool's first) blocks. Shrinking
    engine 0 waited for that submit too (every submit under way), though it goes to an engine that stays; now it
    returns at once, nothing moved. Shrinking engine 1 does wait for it (the request lands there): once submitted it
    is aborted, its partial result recorded, and the sample resumes on engine 0 with its prefix."""
    engine = _engine()
    entered, release = _blocking_submit(engine, "async-0")
    sched = _sched(async_ratio=0)  # one group of one sample: one request
    prompts = iter(range(10**6))
    driver = AsyncRollout(
        engine,
        sched,
        lambda: ("p", [next(prompts)]),
        SamplingParams(max_new_tokens=4),
        timeout_s=WITHIN_S,
        pool=EnginePool([1, 0]),
    )
    try:
        driver.start()
        assert entered.wait(WITHIN_S)
        assert driver.pool is not None and driver.pool.engine_of("async-0") == 1
        other = InThread(lambda: driver.shrink([0]))
        assert other.join(WITHIN_S), "shrink waited for a submit to an engine that stays"
        assert other.error is None and other.result == 0, other.error
        assert driver._submitting == {"async-0"}  # still under way
        driver.expand([0], rebalance=False)
        own = InThread(lambda: driver.shrink([1]))
        _wait(lambda: "async-0" in driver._aborting, "the shrink marked the request being submitted")
        assert not own.join(0.3), "shrink went on while a submit to the engine it removes was under way"
        release.set()
        assert own.join(WITHIN_S) and own.error is None and own.result == 1, own.error
        assert engine.aborts.count("async-0") >= 1 and "async-0" not in engine.running
        assert engine.wait_running(1) == ["async-1"]
        assert engine.requests[-1].prompt_ids == [0, 7] and driver.pool.engine_of("async-1") == 0
    finally:
        release.set()
        driver.close()
        engine.release()


def test_the_requests_lost_in_one_sweep_are_reported_to_the_scheduler_in_one_call() -> None:
    """Partial rollout, two requests running, the engine answers no abort: at the update both are forgotten after
    abort_timeout_s, in one sweep. The driver called `RolloutScheduler.lost` once per id; now once with both, and
    the counts still agree: unanswered + failed aborts == the scheduler's lost requests."""
    engine = _engine()
    sched = _sched(partial_rollout=True)
    prompts = iter(range(10**6))
    driver = AsyncRollout(
        engine,
        sched,
        lambda: ("p", [next(prompts)]),
        SamplingParams(max_new_tokens=4),
        timeout_s=WITHIN_S,
        abort_timeout_s=0.2,
    )
    calls: list[list[str]] = []
    lost = sched.lost

    def spy(request_ids: list[str]) -> int:
        calls.append(list(request_ids))
        return lost(request_ids)

    sched.lost = spy  # type: ignore[method-assign]
    try:
        driver.start()
        engine.wait_running(2)

        def both_submitted() -> bool:
            with driver.held():
                return not driver._submitting and len(driver._handles) == 2

        _wait(both_submitted, "both requests submitted")
        engine.on_abort = "deaf"
        driver.begin_update()
        stats = driver.stats()
    finally:
        driver.close()
        engine.release()
    assert [sorted(c) for c in calls] == [["async-0", "async-1"]]
    assert stats["async/unanswered_aborts"] + stats["async/failed_aborts"] == stats["async/lost_requests"] == 2


@pytest.mark.parametrize("samples", [1, 4])
def test_the_thread_wakes_the_waiters_once_per_submit_round(samples: int) -> None:
    """One group of `samples` samples: one submit round of that many requests. The thread notified every waiter
    after each request (a trainer in `begin_update` woke `samples` times for nothing: no waiter can go on before
    the round's last submit); now once, at the round's end."""
    engine = _engine()
    prompts = iter(range(10**6))
    driver = AsyncRollout(
        engine,
        _sched(group_size=samples, async_ratio=0),
        lambda: ("p", [next(prompts)]),
        SamplingParams(max_new_tokens=4),
        timeout_s=WITHIN_S,
    )
    notified = [0]
    notify_all = driver._cv.notify_all

    def counting() -> None:
        if threading.current_thread() is driver._thread:
            notified[0] += 1
        notify_all()

    driver._cv.notify_all = counting  # type: ignore[method-assign]
    rounds: list[tuple[int, int]] = []
    submit = driver._submit

    def counted(batch: list) -> None:
        before = notified[0]
        submit(batch)
        rounds.append((len(batch), notified[0] - before))

    driver._submit = counted  # type: ignore[method-assign]
    try:
        driver.start()
        engine.wait_running(samples)
        _wait(lambda: bool(rounds), "the submit round ended")
    finally:
        driver.close()
        engine.release()
    assert rounds == [(samples, 1)]


def test_a_reserved_group_is_admitted_even_if_the_tail_allowance_goes_while_its_data_is_drawn() -> None:
    """The driver reserves a group's budget before `next_group` (drawn without its lock): a tail group reserved while
    a slow group ran is started once its data comes, though that group completed meanwhile (the tail allowance is
    gone: a plain start then raises). A start on no reservation raises; `unreserve` gives the budget back."""
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=1, tail_groups=1, order="ready")
    for gid in range(2):
        s.start("p", [gid])
    for sample, _, _ in list(s.pending()):
        s.submitted(sample, f"r{sample.group.gid}")
    s.finish_update()  # version 1: group 0 (version 0) still runs, none complete: one tail group may start
    assert s.capacity() == 1
    s.reserve()
    assert s.capacity() == 0
    s.on_result("r0", [8], [-0.5], "stop")  # group 0 completes: no tail allowance any more
    with pytest.raises(RuntimeError, match="no capacity"):
        s.start("p", [9])
    group = s.start("p", [2], reserved=True)
    assert group.start_version == 1 and s.counters["started_groups"] == 3
    with pytest.raises(RuntimeError, match="without a reserve"):
        s.start("p", [3], reserved=True)
    with pytest.raises(RuntimeError, match="without a reserve"):
        s.unreserve()
    s.discard(s.take(1)[0])  # frees one slot of budget
    assert s.capacity() == 1
    s.reserve()
    s.unreserve()
    assert s.capacity() == 1
