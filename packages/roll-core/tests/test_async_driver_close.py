"""How AsyncRollout (roll_core.scheduling.driver) closes: a `submit_request` that raises after `close` (the engine
shutting down) is one INFO line and the driver stays closed (it failed the driver with an ERROR traceback, and later
calls said "failed"); `close` aborts each request once (it aborted again the requests an update had aborted already);
a `close` that cannot get the driver's lock names the thread that holds it (it always blamed the rollout thread, also
when the holder was a caller inside `held()`). Fake engines, no Ray, no fixed sleeps (the 0.3 s are close's own
bound)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from roll_core.interfaces import Request, SamplingParams
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.held_requests import HeldRequestEngine
from roll_core.testing.threads import InThread

WITHIN_S = 60  # generous: a loaded machine may take seconds to schedule a thread
HOLD_S = 3 * WITHIN_S  # how long a blocked call waits for its release at most (the test's waits end first)
LOGGER = "roll_core.scheduling.driver"


def _prompts() -> Callable[[], tuple]:
    prompts = iter(range(10**6))
    return lambda: ("p", [next(prompts)])


def _driver(engine: HeldRequestEngine, *, async_ratio: int = 1) -> AsyncRollout:
    sched = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=async_ratio)
    return AsyncRollout(engine, sched, _prompts(), SamplingParams(max_new_tokens=4), timeout_s=WITHIN_S)


def _wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WITHIN_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _aborts(engine: HeldRequestEngine) -> collections.Counter:
    with engine.lock:
        return collections.Counter(engine.aborts)


def test_a_submit_that_raises_after_close_is_one_info_line_and_the_driver_stays_closed(caplog) -> None:
    """The engine's submit of async-1 is under way when close() stops the driver, then raises (the engine shuts
    down). That failed the driver: an ERROR traceback ("async rollout thread failed") and later calls said "async
    rollout failed". Now it is one line at INFO, later calls say closed, and what ran (async-0) is aborted once."""
    entered, release = threading.Event(), threading.Event()

    def on_submit(request: Request) -> None:
        if request.request_id == "async-1":
            entered.set()
            release.wait(HOLD_S)
            raise ConnectionError("the inference engine is shutting down")

    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8], on_submit=on_submit)
    driver = _driver(engine)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    try:
        driver.start()
        assert entered.wait(WITHIN_S)
        closer = InThread(driver.close)
        _wait(lambda: driver._stopped, "close did not stop the driver")
        release.set()
        assert closer.join(WITHIN_S) and closer.error is None, closer.error
        assert driver._thread is not None and not driver._thread.is_alive()
        with pytest.raises(RuntimeError, match="async rollout closed"):
            driver.take(1)
    finally:
        release.set()
        engine.release()
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    (line,) = [r for r in records if "submit" in r.getMessage()]
    assert line.levelno == logging.INFO and line.exc_info is None
    assert line.getMessage() == (
        "async rollout: a submit after close() (a shutdown) raised: request async-1 (group 1, sample 0) failed in the "
        "inference engine: ConnectionError: the inference engine is shutting down"
    )
    assert _aborts(engine) == {"async-0": 1}


def test_close_aborts_each_request_once_not_again_one_an_update_aborted() -> None:
    """async_ratio 0: async-0 runs across the weight update, so finish_update aborts it (its group restarts as
    async-1); the engine does not answer that abort (its result never comes, the request stays known to the driver
    until abort_timeout_s). close() aborted every request it knew again: async-0 twice. Now once each."""
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8], on_abort="deaf")
    driver = _driver(engine, async_ratio=0)
    try:
        driver.start()
        assert engine.wait_running(1) == ["async-0"]
        driver.begin_update()  # no partial rollout: nothing is aborted here
        driver.finish_update()
        assert _aborts(engine) == {"async-0": 1}
        assert engine.wait_running(2) == ["async-0", "async-1"]  # async-0: the deaf engine keeps it
        assert "async-0" in driver._handles  # still awaited: the abort's bound has not passed
        driver.close()
        assert driver._thread is not None and not driver._thread.is_alive()
        assert _aborts(engine) == {"async-0": 1, "async-1": 1}
    finally:
        driver.close()
        engine.release()


def test_a_close_that_cannot_get_the_lock_names_the_caller_inside_held_not_the_rollout_thread(caplog) -> None:
    """A caller on another thread holds the driver's lock in `held()` (a checkpoint) when close() gives up on it.
    The warning blamed thread 'roll-async-rollout' (its stack: waiting for that lock). Now it names the caller's
    thread and where it is; once the caller lets go, the rollout thread aborts what runs (once)."""
    inside, release = threading.Event(), threading.Event()
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    driver = _driver(engine, async_ratio=0)
    driver.close_timeout_s = 0.3

    def checkpoint() -> None:
        with driver.held():
            inside.set()
            release.wait(HOLD_S)

    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        driver.start()
        assert engine.wait_running(1) == ["async-0"]
        holder = InThread(checkpoint, name="roll-test-checkpoint")
        assert inside.wait(WITHIN_S)
        driver.close()
        release.set()
        assert holder.join(WITHIN_S) and holder.error is None, holder.error
        assert driver._thread is not None
        driver._thread.join(WITHIN_S)
        assert not driver._thread.is_alive()
        assert _aborts(engine) == {"async-0": 1}
    finally:
        release.set()
        engine.release()
    (msg,) = [r.getMessage() for r in caplog.records if "close()" in r.getMessage()]
    assert msg.startswith(
        "async rollout: close() could not get the driver's lock within 0.3s: thread 'roll-test-checkpoint' holds it, "
        "a caller of held() (a checkpoint reading the groups?): stuck in "
    ), msg
    assert "checkpoint (test_async_driver_close.py:" in msg, msg
    assert "roll-async-rollout" not in msg


def test_a_close_that_cannot_get_the_lock_names_the_rollout_thread_when_it_holds_it(caplog) -> None:
    """The rollout thread holds the driver's lock (recording a result: the scheduler's `on_result` blocks) when
    close() gives up on it: the warning names that thread, what it does and where."""
    inside, release = threading.Event(), threading.Event()
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    driver = _driver(engine, async_ratio=0)
    driver.close_timeout_s = 0.3
    on_result = driver.sched.on_result

    def blocking_on_result(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        release.wait(HOLD_S)
        return on_result(*args, **kwargs)

    driver.sched.on_result = blocking_on_result  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        driver.start()
        engine.wait_running(1)
        engine.serve()
        assert inside.wait(WITHIN_S)
        driver.close()
    finally:
        release.set()
        engine.release()
    assert driver._thread is not None
    driver._thread.join(WITHIN_S)
    assert not driver._thread.is_alive()
    (msg,) = [r.getMessage() for r in caplog.records if "close()" in r.getMessage()]
    assert msg.startswith(
        "async rollout: close() could not get the driver's lock within 0.3s: the rollout thread 'roll-async-rollout' "
        "holds it: polling the request handles and reading the finished ones' results; stuck in "
    ), msg
    assert "blocking_on_result (test_async_driver_close.py:" in msg, msg


class _HeldElsewhere:
    """A lock some other caller holds: every acquire times out; nothing is known about its holder."""

    owner = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return False

    def release(self) -> None:
        raise AssertionError("never acquired")


def test_a_close_that_cannot_get_the_lock_from_an_unknown_holder_says_who_it_may_be(caplog) -> None:
    """The holder let go just as close() gave up (none is known): the warning says "a caller of held() or the
    rollout thread" instead of blaming the rollout thread (whose stack it printed as if stuck)."""
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    driver = _driver(engine)
    driver.close_timeout_s = 0.01
    driver._lock = lock = _HeldElsewhere()  # type: ignore[assignment]
    driver._cv = threading.Condition(lock)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    driver.close()
    assert driver._stopped
    (msg,) = [r.getMessage() for r in caplog.records if "close()" in r.getMessage()]
    assert msg == (
        "async rollout: close() could not get the driver's lock within 0.01s: a caller of held() or the rollout "
        "thread (it let go as close gave up) holds it. The driver is closed without it (the rollout thread aborts its "
        "running requests once it gets the lock)"
    ), msg
