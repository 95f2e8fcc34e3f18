"""AsyncRollout and requests that never return (roll_core.scheduling.driver, "Requests that never return"): an
aborted request whose handle never completes is forgotten after `abort_timeout_s` and reported lost (its sample
resumes with its prefix kept, a stale group's id is forgotten), an aborted request whose handle raises is a loss
too (the rollout goes on), and a live request whose handle raises stops the rollout with an error that names it,
raised in the trainer's call instead of a wait for a batch that never completes. Fake engines, no Ray."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from roll_core.interfaces import Request, SamplingParams
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.pool import EnginePool
from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.held_requests import HeldRequestEngine, once_per
from roll_core.testing.threads import InThread

BOUND = 0.2  # abort_timeout_s in these tests: short, since waiting it out is what they test


def _engine(**kwargs: Any) -> HeldRequestEngine:
    """Requests held until the test acts on them: an aborted one ends with one generated token (7), a served one with
    one token (8), each of log-prob -0.5; `kwargs` go to HeldRequestEngine (`on_abort`, `preempt`)."""
    return HeldRequestEngine(abort_tokens=[7], serve_tokens=[8], serve_logprob=-0.5, **kwargs)


def _first_of_each_prompt() -> Callable[[Request], bool]:
    """A `preempt`: the engine aborts the first request of each prompt itself at once with one token (7); the sample
    resumes from [prompt, 7] within the same version."""
    return once_per(lambda request: request.prompt_ids[0])


def _driver(engine: HeldRequestEngine, sched: RolloutScheduler, abort_timeout_s: float = BOUND) -> AsyncRollout:
    prompts = iter(range(10**6))
    params = SamplingParams(max_new_tokens=4)
    return AsyncRollout(
        engine, sched, lambda: ("p", [next(prompts)]), params, timeout_s=30, abort_timeout_s=abort_timeout_s
    )


def _partial_sched() -> RolloutScheduler:
    # (k + 1) B = 2 groups of one sample: prompts [0] and [1], two requests running
    return RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=1, partial_rollout=True)


def _driver_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "roll_core.scheduling.driver" and r.levelno >= 30]


def test_an_aborted_request_that_never_returns_is_forgotten_and_its_sample_resumes_with_its_prefix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Partial rollout: the engine preempts each sample once (it keeps the prefix [7] and resumes); then, at the
    weight update, the engine has restarted and answers no abort. The update waited 60 s and failed the run, and
    the handles stayed in the driver for good. Now, after abort_timeout_s, they are forgotten and reported lost: the
    update goes on, each sample resumes from [prompt, 7] (the lost request's own tokens are gone), and the batch
    completes."""
    engine = _engine(preempt=_first_of_each_prompt())
    sched = _partial_sched()
    driver = _driver(engine, sched)
    caplog.set_level(logging.WARNING, logger="roll_core.scheduling.driver")
    try:
        driver.start()
        engine.wait_running(2)  # the continuations [0, 7] and [1, 7]
        lost = sorted(engine.running)
        engine.on_abort, engine.preempt = "deaf", None
        t0 = time.monotonic()
        driver.begin_update()  # waits abort_timeout_s, then goes on without the lost requests
        assert time.monotonic() - t0 < 10
        assert not set(lost) & (set(driver._handles) | set(driver._aborting))
        stats = driver.stats()
        assert stats["async/unanswered_aborts"] == 2 and stats["async/lost_requests"] == 2
        assert stats["async/failed_aborts"] == 0 and stats["async/dropped_requests_waiting"] == 0
        mark = len(engine.requests)
        driver.finish_update()
        engine.wait_running(4)  # the two lost requests (still "running" in the deaf engine) and their resumptions
        after = {tuple(r.prompt_ids): r.params.max_new_tokens for r in engine.requests[mark:]}
        assert after == {(0, 7): 3, (1, 7): 3}  # the prefix counts against max_new_tokens
        engine.serve()
        [group] = driver.take(1)
    finally:
        driver.close()
    assert group.samples[0].tokens == [7, 8] and sched.counters["resumed_requests"] == 4
    warnings = _driver_warnings(caplog)
    assert len(warnings) == 1 and "2 (" in warnings[0] and "no result within 0.2 s" in warnings[0]


def test_a_stale_groups_unanswered_abort_is_forgotten_and_shown_as_a_gauge_meanwhile() -> None:
    """Order "ready": at version 2 the two groups admitted at version 0 are too stale, dropped and aborted, and the
    engine answers neither abort. `async/dropped_requests_waiting` shows the two while the bound runs; then the
    driver forgets them (no handle, no scheduler id left) instead of keeping both for good."""
    engine = _engine(on_abort="deaf")
    sched = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=1, order="ready")
    driver = _driver(engine, sched, abort_timeout_s=3600)  # nothing is forgotten until the bound is lowered below
    try:
        driver.start()
        engine.wait_running(2)
        driver.begin_update()
        driver.finish_update()
        driver.begin_update()
        driver.finish_update()  # version 2: groups 0 and 1 (requests async-0, async-1) are dropped
        assert sched.counters["stale_groups"] == 2
        stats = driver.stats()
        assert stats["async/dropped_requests_waiting"] == 2 and stats["async/unanswered_aborts"] == 0
        driver.abort_timeout_s = BOUND
        deadline = time.monotonic() + 60
        while sched.dropped_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = driver.stats()
        assert stats["async/dropped_requests_waiting"] == 0
        assert stats["async/unanswered_aborts"] == 2 and stats["async/lost_requests"] == 2
        assert not {"async-0", "async-1"} & (set(driver._handles) | set(driver._aborting))
        assert driver._thread is not None and driver._thread.is_alive()
    finally:
        driver.close()


def test_an_aborted_request_whose_handle_raises_is_lost_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    """At a weight update the engine's worker died: the aborted requests' handles raise. That killed the rollout
    thread (the update raised "async rollout failed"), though the requests were being thrown away anyway. They are
    lost requests now: counted, warned once, the samples resume and the batch completes."""
    engine = _engine()
    sched = _partial_sched()
    driver = _driver(engine, sched)
    caplog.set_level(logging.WARNING, logger="roll_core.scheduling.driver")
    try:
        driver.start()
        engine.wait_running(2)
        engine.on_abort = "raise"
        driver.begin_update()
        mark = len(engine.requests)
        driver.finish_update()
        engine.wait_running(2)  # resumed: nothing generated before, so the same prompts again
        assert sorted(r.prompt_ids for r in engine.requests[mark:]) == [[0], [1]]
        engine.serve()
        [group] = driver.take(1)
        stats = driver.stats()
    finally:
        driver.close()
    assert group.samples[0].tokens == [8]
    assert stats["async/failed_aborts"] == 2 and stats["async/lost_requests"] == 2
    assert stats["async/unanswered_aborts"] == 0
    # One warning for the version; the thread may have collected the two failures in two sweeps, the second then
    # summed up at the update.
    warnings = _driver_warnings(caplog)
    summary = (
        "async rollout: 1 more aborted request(s) lost at version 0 (async/failed_aborts 1): forgotten, their samples "
        "resume with their earlier prefixes"
    )
    assert "ConnectionError: the engine's worker died" in warnings[0], warnings
    assert (warnings[0].count("async-") == 2 and len(warnings) == 1) or (
        warnings[0].count("async-") == 1 and warnings[1:] == [summary]
    ), warnings


def test_losses_after_a_versions_first_warning_are_summed_up_at_close_when_no_update_ends_the_version(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Partial-GPU mode, the engine answers no abort. Engine 1 leaves (its request async-1 is lost: the version's
    first warning, at once), the sample resumes on engine 0 (async-2), then engine 0 leaves too (async-0 and async-2
    lost: summed up later). The summary came at the next finish_update only: losses of the last version before close
    were counted in the stats but never warned about. Now close sums them up, with the right version and cause."""
    engine = _engine(on_abort="deaf")
    sched = _partial_sched()
    prompts = iter(range(10**6))
    params = SamplingParams(max_new_tokens=4)
    pool = EnginePool([0, 1])
    driver = AsyncRollout(
        engine, sched, lambda: ("p", [next(prompts)]), params, timeout_s=30, abort_timeout_s=BOUND, pool=pool
    )
    caplog.set_level(logging.WARNING, logger="roll_core.scheduling.driver")
    try:
        driver.start()
        assert engine.wait_running(2) == ["async-0", "async-1"]  # async-0 on engine 0, async-1 on engine 1
        assert driver.shrink([1]) == 1  # returns once async-1 is forgotten as lost
        engine.wait_running(3)  # the deaf engine still lists async-1; its sample resumed as async-2, on engine 0
        assert driver.shrink([0]) == 2
        stats = driver.stats()
        assert stats["async/unanswered_aborts"] == 3 and stats["async/lost_requests"] == 3
        assert len(_driver_warnings(caplog)) == 1
    finally:
        driver.close()
    first, summary = _driver_warnings(caplog)
    assert "at version 0: 1 (async-1) brought no result within 0.2 s" in first
    assert summary == (
        "async rollout: 2 more aborted request(s) lost at version 0 (async/unanswered_aborts 2): forgotten, their "
        "samples resume with their earlier prefixes"
    )


def test_a_live_request_whose_handle_raises_fails_the_batch_naming_it() -> None:
    """A request nobody aborted raises (the engine failed): the trainer's `take` raises at once, naming the request,
    its group and sample, chained to the engine's error; it neither hangs for timeout_s nor resubmits in silence.
    Later calls (an update) raise the same."""
    engine = _engine()
    driver = _driver(engine, _partial_sched())
    boom = ValueError("CUDA error: an illegal memory access was encountered")
    try:
        driver.start()
        engine.wait_running(2)
        trainer = InThread(lambda: driver.take(1))
        engine.fail(boom)
        assert trainer.join(10)  # timeout_s is 30: a take that only timed out would still be waiting here
        err = trainer.error
        assert isinstance(err, RuntimeError)
        assert "request async-" in str(err) and "(group " in str(err) and "failed in the inference engine" in str(err)
        assert "ValueError: CUDA error" in str(err) and err.__cause__ is not None and err.__cause__.__cause__ is boom
        with pytest.raises(RuntimeError, match="failed in the inference engine"):
            driver.begin_update()
    finally:
        driver.close()


def test_abort_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="abort_timeout_s=0"):
        _driver(_engine(), _partial_sched(), abort_timeout_s=0)


def test_a_stale_groups_request_the_scheduler_pruned_is_not_counted_again_as_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Order "ready", dropped_ttl=1, an engine that answers no abort. At version 2 groups 0 and 1 are dropped as
    stale (async-0, async-1 aborted); at version 3 the scheduler forgets their ids (`pruned_requests`, warned). When
    the driver's abort bound ran out, it counted both again in `async/unanswered_aborts` and warned about them again,
    while `async/lost_requests` (the scheduler's) said 0: two counts and two warnings for one loss. Now the pruned
    ones are forgotten without a second count: unanswered_aborts agrees with lost_requests."""
    engine = _engine(on_abort="deaf")
    sched = RolloutScheduler(
        batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=1, order="ready", dropped_ttl=1
    )
    driver = _driver(engine, sched, abort_timeout_s=3600)  # nothing is forgotten until the bound is lowered below
    caplog.set_level(logging.WARNING, logger="roll_core.scheduling.driver")
    try:
        driver.start()
        engine.wait_running(2)  # async-0, async-1 (groups 0 and 1, version 0)
        for _ in range(3):
            driver.begin_update()
            driver.finish_update()
        assert sched.counters["stale_groups"] == 2 and sched.counters["pruned_requests"] == 2
        assert sched.dropped_requests() == 0
        driver.abort_timeout_s = BOUND
        gone = {"async-0", "async-1"}
        deadline = time.monotonic() + 60
        while gone & (set(driver._handles) | set(driver._aborting)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not gone & (set(driver._handles) | set(driver._aborting))
        stats = driver.stats()
    finally:
        driver.close()
    assert stats["async/pruned_requests"] == 2 and stats["async/lost_requests"] == 0
    assert stats["async/unanswered_aborts"] == 0 and stats["async/failed_aborts"] == 0
    assert [w for w in _driver_warnings(caplog) if "lost at version" in w] == []
