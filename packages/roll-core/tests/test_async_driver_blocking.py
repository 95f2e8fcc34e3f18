"""AsyncRollout (roll_core.scheduling.driver) with a call that blocks: the engine's `submit_request`, or the data's
`next_group`. The driver thread submitted while holding the driver's lock, so a submit that never returned blocked
`close` (shutdown hung for good instead of `close_timeout_s`), `take` (its `timeout_s` never fired) and the weight
updates. Now the engine is called without the lock, `next_group` on a data thread without it
(test_async_driver_data_waits), and `close` waits for the lock at most `close_timeout_s`. Fake engines, no Ray."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from roll_core.interfaces import Request, SamplingParams
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.held_requests import HeldRequestEngine
from roll_core.testing.threads import InThread


def _blocking_submit(rid: str, entered: threading.Event, release: threading.Event) -> Callable[[Request], None]:
    """An `on_submit` under which the engine's submit of request `rid` does not return until `release` is set."""

    def on_submit(request: Request) -> None:
        if request.request_id == rid:
            entered.set()
            release.wait(60)

    return on_submit


def _driver(engine: HeldRequestEngine, next_group: Callable[[], tuple], timeout_s: float = 30) -> AsyncRollout:
    # (k + 1) B = 2 groups of one sample: requests async-0 (prompt [0]) and async-1 (prompt [1])
    sched = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=1, partial_rollout=True)
    return AsyncRollout(engine, sched, next_group, SamplingParams(max_new_tokens=4), timeout_s=timeout_s)


def _prompts() -> Callable[[], tuple]:
    prompts = iter(range(10**6))
    return lambda: ("p", [next(prompts)])


def _wait(cond: Callable[[], bool], what: str, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_submit_that_never_returns_blocks_neither_takes_timeout_nor_close(caplog: pytest.LogCaptureFixture) -> None:
    """The engine's submit of async-1 blocks. The trainer's take (timeout 0.3 s) and close (0.3 s) both blocked on
    the driver's lock until the submit returned, for good with a hung engine. Now the take times out saying which
    submit does not return, close returns after its bound with a warning saying what the thread does, and once the
    engine does return, the thread aborts that request (close asked for it) and ends: nothing is left running."""
    entered, release = threading.Event(), threading.Event()
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    engine.on_submit = _blocking_submit("async-1", entered, release)
    driver = _driver(engine, _prompts(), timeout_s=0.3)
    driver.close_timeout_s = 0.3
    caplog.set_level(logging.WARNING, logger="roll_core.scheduling.driver")
    try:
        driver.start()
        assert entered.wait(10)
        trainer = InThread(lambda: driver.take(1))
        assert trainer.join(10), "take did not time out: it waits for the lock a blocked submit holds"
        assert isinstance(trainer.error, TimeoutError), trainer.error
        msg = str(trainer.error)
        assert "1 request(s) running (oldest first, time since submitted): async-0 (" in msg, msg
        assert "1 request(s) (async-1) still being submitted, the oldest for " in msg, msg
        assert msg.endswith("(the engine's submit_request does not return)"), msg
        closer = InThread(driver.close)
        assert closer.join(10), "close did not return: it waits for the lock a blocked submit holds"
        assert closer.error is None, closer.error
        with pytest.raises(RuntimeError, match="closed"):
            driver.take(1)
        assert engine.aborts == ["async-0"]  # what ran; async-1 is not known to the engine yet
        release.set()
        assert driver._thread is not None
        driver._thread.join(10)
        assert not driver._thread.is_alive()
    finally:
        release.set()
        engine.release()
    (stuck,) = [r.getMessage() for r in caplog.records if "after close()" in r.getMessage()]
    assert "still alive 0.3s after close() (left running, a daemon): submitting requests (the engine's " in stuck
    assert sorted(engine.aborts) == ["async-0", "async-1"] and not engine.running  # async-1 aborted once submitted


def test_an_update_waits_for_a_submit_under_way_and_aborts_its_request_once_submitted() -> None:
    """Partial rollout, the engine's submit of async-1 blocks, and the trainer begins a weight update: the update
    does not go on while a submit is under way (the request would land on weights being changed); once the submit
    returns, its request is aborted with the other and both resume after the update."""
    entered, release = threading.Event(), threading.Event()
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    engine.on_submit = _blocking_submit("async-1", entered, release)
    driver = _driver(engine, _prompts())
    try:
        driver.start()
        assert entered.wait(10)
        engine.wait_running(1)  # async-0
        update = InThread(driver.begin_update)
        _wait(lambda: "async-0" in engine.aborts, "begin_update aborted the running request")
        assert not update.join(0.3), "the update went on while a submit was under way"
        release.set()
        assert update.join(10) and update.error is None, update.error
        # (begin_update also asked the engine to abort async-1 before it knew the request: a no-op)
        assert set(engine.aborts) == {"async-0", "async-1"} and not engine.running
        assert not driver._handles and not driver._submitting
        driver.finish_update()
        resumed = engine.wait_running(2)
        assert sorted(r.prompt_ids for r in engine.requests if r.request_id in resumed) == [[0, 7], [1, 7]]
        engine.serve()
        [group] = driver.take(1)
        assert group.samples[0].tokens == [7, 8]
    finally:
        release.set()
        driver.close()
        engine.release()


def test_a_submit_that_raises_during_an_update_fails_the_update_naming_the_request() -> None:
    """The engine's submit of async-1 blocks, the trainer begins a weight update (it waits for the submit), then
    the submit raises. The submit's end was signalled before the thread stored the error, so the update woke to no
    submit under way and went on as if nothing had failed (the error came at some later call, naming no request).
    Now the update raises, naming the request and chained to the engine's error."""
    entered, release = threading.Event(), threading.Event()
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])

    def on_submit(request: Request) -> None:
        if request.request_id == "async-1":
            entered.set()
            release.wait(60)
            raise ConnectionError("engine went away")

    engine.on_submit = on_submit
    driver = _driver(engine, _prompts())
    try:
        driver.start()
        assert entered.wait(10)
        engine.wait_running(1)  # async-0
        update = InThread(driver.begin_update)
        _wait(lambda: "async-0" in engine.aborts, "begin_update aborted the running request", within_s=60)
        release.set()
        assert update.join(60)
        assert isinstance(update.error, RuntimeError), "the update went on past a failed submit"
        assert "request async-1 (group 1, sample 0) failed in the inference engine: ConnectionError" in str(
            update.error
        ), update.error
        assert isinstance(update.error.__cause__.__cause__, ConnectionError)
    finally:
        release.set()
        driver.close()
        engine.release()


def test_a_close_while_next_group_blocks_returns_after_its_bound() -> None:
    """The data's `next_group` blocks while the thread held the driver's lock (it started groups under it, so a
    checkpoint reads a consistent data position): close waited for the lock for good. Now `next_group` runs on the
    data thread without it: close returns (after `close_timeout_s` for that thread, with a warning), a take raises
    that the driver is closed, and when `next_group` returns nothing more is submitted and the threads end. (The
    first group, drawn before, runs meanwhile: close aborts it.)"""
    entered, release = threading.Event(), threading.Event()
    prompts = iter(range(10**6))

    def next_group() -> tuple:
        prompt = next(prompts)
        if prompt == 1:  # the second group's data does not come
            entered.set()
            release.wait(60)
        return ("p", [prompt])

    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    driver = _driver(engine, next_group)
    driver.close_timeout_s = 0.3
    try:
        driver.start()
        assert entered.wait(10)
        assert engine.wait_running(1) == ["async-0"]  # the group drawn before the blocked one
        closer = InThread(driver.close)
        assert closer.join(10), "close did not return: it waits for the lock next_group's caller holds"
        assert closer.error is None, closer.error
        release.set()
        for thread in (driver._thread, driver._feeder):
            assert thread is not None
            thread.join(10)
            assert not thread.is_alive()
        with pytest.raises(RuntimeError, match="closed"):
            driver.take(1)
    finally:
        release.set()
        engine.release()
    # nothing was submitted after close, and what ran was aborted
    assert [r.request_id for r in engine.requests] == ["async-0"] and engine.aborts == ["async-0"]
    assert not engine.running


def test_a_close_while_next_group_blocks_draws_no_more_data_after_it() -> None:
    """Budget for three groups; the data's `next_group` blocks on the second one and close gives up on the lock.
    When that call returned, the thread went on starting groups up to the budget, drawing a third prompt from the
    data (a call that may block as long) for a driver already closed. Now it stops drawing at once."""
    entered, release = threading.Event(), threading.Event()
    drawn: list[int] = []
    prompts = iter(range(10**6))

    def next_group() -> tuple:
        prompt = next(prompts)
        drawn.append(prompt)
        if prompt == 1:
            entered.set()
            release.wait(60)
        return ("p", [prompt])

    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    # (k + 1) B = 3 groups of one sample
    sched = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=2)
    driver = AsyncRollout(engine, sched, next_group, SamplingParams(max_new_tokens=4), timeout_s=30)
    driver.close_timeout_s = 0.3
    try:
        driver.start()
        assert entered.wait(10)
        assert engine.wait_running(1) == ["async-0"]  # the group drawn before the blocked one
        closer = InThread(driver.close)
        assert closer.join(10) and closer.error is None, closer.error
        release.set()
        for thread in (driver._thread, driver._feeder):
            assert thread is not None
            thread.join(10)
            assert not thread.is_alive()
    finally:
        release.set()
        engine.release()
    assert drawn == [0, 1] and [r.request_id for r in engine.requests] == ["async-0"]
