"""How AsyncRollout (roll_core.scheduling.driver) stops: a failure of either thread aborts the running requests at
once (they generated for nobody until `close`); a `next_group` that raises after `close` (a dataloader torn down at
shutdown) is one line at INFO and the driver stays closed, not failed; a `close` that gives up on the data thread says
what it waits for (a draw, naming the data source and how long, or the driver's data lock), not always "drawing a
group". Fake engines, no Ray, no fixed sleeps."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from roll_core.interfaces import SamplingParams
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.held_requests import HeldRequestEngine
from roll_core.testing.threads import InThread

WITHIN_S = 60  # generous: a loaded machine may take seconds to schedule a thread
HOLD_S = 3 * WITHIN_S  # how long a blocked call waits for its release at most (the test's waits end first)
LOGGER = "roll_core.scheduling.driver"


class _Data:
    """`next_group`: prompts [0], [1], ...; the draw of prompt `block_at` waits for `release` (`entered`: it began),
    then raises `error` when set."""

    def __init__(self, block_at: int | None = None) -> None:
        self.block_at = block_at
        self.entered, self.release = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.drawn = 0

    def next_group(self) -> tuple:
        prompt, self.drawn = self.drawn, self.drawn + 1
        if prompt == self.block_at:
            self.entered.set()
            self.release.wait(HOLD_S)
            if self.error is not None:
                raise self.error
        return ("p", [prompt])


class _TriedLock:
    """The driver's data lock, saying (`tried`) when a thread began to acquire it."""

    def __init__(self, lock: Any) -> None:
        self.lock, self.tried = lock, threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.tried.set()
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> _TriedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _driver(engine: HeldRequestEngine, data: _Data, *, group_size: int = 1, async_ratio: int = 1) -> AsyncRollout:
    sched = RolloutScheduler(batch_groups=1, group_size=group_size, max_new_tokens=4, async_ratio=async_ratio)
    return AsyncRollout(engine, sched, data.next_group, SamplingParams(max_new_tokens=4), timeout_s=WITHIN_S)


def _wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WITHIN_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _aborts(engine: HeldRequestEngine) -> list[str]:
    with engine.lock:
        return sorted(engine.aborts)


def test_a_data_thread_failure_aborts_the_running_requests_at_once() -> None:
    """Group 0's two requests run when the draw of group 1 raises. The rollout thread ended without aborting them:
    they generated for nobody until close(). Now they are aborted at once; the take raises the data source's error."""
    data = _Data(block_at=1)
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    driver = _driver(engine, data, group_size=2)
    try:
        driver.start()
        assert engine.wait_running(2) == ["async-0", "async-1"]
        assert data.entered.wait(WITHIN_S)
        data.error = ValueError("dataloader broke")
        data.release.set()
        _wait(lambda: _aborts(engine) == ["async-0", "async-1"], "the running requests were not aborted")
        with pytest.raises(RuntimeError, match=r"async rollout failed: the data source .* raised ValueError"):
            driver.take(1)
        assert not engine.running
    finally:
        data.release.set()
        driver.close()
        engine.release()


def test_an_engine_failure_of_one_request_aborts_the_others_at_once() -> None:
    """One group of two samples: request async-0 fails in the engine while async-1 runs. async-1 ran on until
    close(); now it is aborted at once, and the take raises the failure naming async-0."""
    data = _Data()
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    driver = _driver(engine, data, group_size=2, async_ratio=0)
    try:
        driver.start()
        assert engine.wait_running(2) == ["async-0", "async-1"]
        with engine.lock:
            _, handle = engine.running.pop("async-0")
        handle.set_exception(ConnectionError("engine worker died"))
        _wait(lambda: _aborts(engine) == ["async-1"], "the other running request was not aborted")
        with pytest.raises(RuntimeError, match=r"request async-0 \(group 0, sample 0\) failed in the inference engine"):
            driver.take(1)
        assert not engine.running
    finally:
        driver.close()
        engine.release()


def test_a_next_group_that_raises_after_close_is_one_info_line_and_the_driver_stays_closed(caplog) -> None:
    """The draw of group 1 blocks; close() stops the driver and, while it joins the data thread, the data source
    raises (its dataloader torn down by the shutdown). That was logged with a full traceback at ERROR, and later
    calls said "async rollout failed" instead of closed. Now it is one line at INFO, and later calls say closed."""
    data = _Data(block_at=1)
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    driver = _driver(engine, data)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    try:
        driver.start()
        assert data.entered.wait(WITHIN_S)
        closer = InThread(driver.close)
        _wait(lambda: driver._stopped, "close did not stop the driver")
        data.error = OSError("dataloader workers shut down")
        data.release.set()
        assert closer.join(WITHIN_S) and closer.error is None, closer.error
        assert driver._feeder is not None and not driver._feeder.is_alive()
        with pytest.raises(RuntimeError, match="async rollout closed"):
            driver.take(1)
    finally:
        data.release.set()
        engine.release()
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r for r in records if r.levelno >= logging.WARNING] == []
    (line,) = [r for r in records if "data source" in r.getMessage()]
    assert line.levelno == logging.INFO and line.exc_info is None
    assert line.getMessage().startswith(
        "async rollout: the data source failed after close() (a shutdown): RuntimeError: the data source "
    )
    assert line.getMessage().endswith("raised OSError: dataloader workers shut down")


def test_a_close_that_gives_up_on_the_data_thread_waiting_for_the_data_lock_says_so(caplog) -> None:
    """The data thread waits for the driver's data lock (a checkpoint's `held` has it) when close() gives up on it.
    The warning said it was "drawing a group" from the data source, which was never called. Now it says what the
    thread waits for; no group starts after close once the lock is free."""
    data = _Data()
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    driver = _driver(engine, data)
    driver.close_timeout_s = 0.3
    lock = _TriedLock(driver._data_lock)
    driver._data_lock = lock  # type: ignore[assignment]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    lock.lock.acquire()
    try:
        driver.start()
        assert lock.tried.wait(WITHIN_S)
        driver.close()
    finally:
        lock.lock.release()
        engine.release()
    assert driver._feeder is not None
    driver._feeder.join(WITHIN_S)
    assert not driver._feeder.is_alive()
    assert data.drawn == 0 and driver.sched.counters["started_groups"] == 0
    (msg,) = [r.getMessage() for r in caplog.records if "after close()" in r.getMessage()]
    assert msg.startswith(
        "async rollout: thread 'roll-async-data' still alive 0.3s after close() (left running, a daemon): waiting for "
        "the driver's data lock (a held() under way: a checkpoint?); stuck in "
    ), msg
    assert "drawing" not in msg


def test_a_close_that_gives_up_on_a_draw_names_the_data_source_and_how_long_it_has_blocked(caplog) -> None:
    """The data source blocks when close() gives up on the data thread: the warning names it and says how long it
    has not returned (it said "drawing a group (name)" only)."""
    data = _Data(block_at=0)
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    driver = _driver(engine, data)
    driver.close_timeout_s = 0.3
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        driver.start()
        assert data.entered.wait(WITHIN_S)
        driver.close()
    finally:
        data.release.set()
        engine.release()
    (msg,) = [r.getMessage() for r in caplog.records if "after close()" in r.getMessage()]
    assert msg.startswith(
        "async rollout: thread 'roll-async-data' still alive 0.3s after close() (left running, a daemon): drawing a "
        "group: the data source _Data.next_group has not returned for "
    ), msg
    assert "next_group (test_async_driver_stops.py:" in msg, msg
