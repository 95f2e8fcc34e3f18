"""AsyncRollout (the driver thread) over a fake request API: a request the engine keeps aborting on its own without
a token fails the rollout with the cause instead of being resubmitted in a busy loop, while the aborts the driver
asks for (weight updates with partial rollout) and a few engine-side ones (preemption) still resume."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from roll_core.cluster.reward_guard import RewardFailureBudget
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.protocol import Batch
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.pool import EnginePool
from roll_core.scheduling.scheduler import GroupState, RolloutScheduler, SampleState, Segment
from roll_core.testing.threads import InThread


class _Engine:
    """The request API of an inference group. A request runs until aborted (no token), or until `serve()`, which
    finishes the running ones and every later one at once (one token each). `refuse`: every request is aborted by
    the engine at once (SGLang's answer to a prompt longer than it accepts); `preempt`: the engine aborts the
    first request of each prompt on its own."""

    def __init__(self, *, refuse: bool = False, preempt: bool = False) -> None:
        self.refuse, self.preempt, self.serving = refuse, preempt, False
        self.lock = threading.Lock()
        self.running: dict[str, tuple[Request, Future]] = {}
        self.submitted = 0
        self.preempted: set[tuple[int, ...]] = set()

    def submit_request(self, request: Request, rank: int | None = None) -> Future:
        fut: Future = Future()
        with self.lock:
            self.submitted += 1
            key = tuple(request.prompt_ids)
            if self.refuse or (self.preempt and key not in self.preempted):
                self.preempted.add(key)
                fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "abort"))
            elif self.serving:
                fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [7], [-0.5], "stop"))
            else:
                self.running[request.request_id] = (request, fut)
        return fut

    def abort(self, request_id: str) -> bool:
        with self.lock:
            item = self.running.pop(request_id, None)
        if item is None:
            return False
        item[1].set_result(RequestOutput(request_id, item[0].prompt_ids, [], [], "abort"))
        return True

    def finish(self, prompt: int) -> None:
        """Finish the running requests of the group whose prompt is [prompt] (one token each)."""
        with self.lock:
            rids = [rid for rid, (req, _) in self.running.items() if req.prompt_ids[0] == prompt]
            items = [self.running.pop(rid) for rid in rids]
        for request, fut in items:
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [7], [-0.5], "stop"))

    def serve(self) -> None:
        with self.lock:
            items, self.running, self.serving = list(self.running.values()), {}, True
        for request, fut in items:
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [7], [-0.5], "stop"))


def _driver(engine: _Engine, timeout_s: float, pool: EnginePool | None = None) -> AsyncRollout:
    prompts = iter(range(10**6))
    sched = RolloutScheduler(batch_groups=1, group_size=2, max_new_tokens=4, async_ratio=1, partial_rollout=True)
    params = SamplingParams(max_new_tokens=4)
    return AsyncRollout(engine, sched, lambda: ("p", [next(prompts)]), params, timeout_s=timeout_s, pool=pool)


def _wait_running(engine: _Engine, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(engine.running) < n and time.monotonic() < deadline:
        time.sleep(0.002)


def test_a_request_the_engine_keeps_aborting_fails_the_rollout_with_the_cause() -> None:
    """An engine-side abort resumes the sample; an engine that aborts a request every time (no token) had it
    resubmitted in a busy loop (~10^5 requests a second) and the trainer waited out timeout_s (an hour in a run)
    for a TimeoutError that did not say why."""
    engine = _Engine(refuse=True)
    driver = _driver(engine, timeout_s=3)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"aborted request .* 8 times in a row without generating a token"):
            driver.take(1)
    finally:
        driver.close()
    assert time.monotonic() - t0 < 2 and engine.submitted < 100


@pytest.mark.parametrize("partial_gpu", [False, True])
def test_aborts_the_driver_asks_for_and_an_engine_preemption_still_resume(partial_gpu: bool) -> None:
    """Partial rollout aborts every running request at each weight update (no token yet, 12 updates in a row);
    in partial-GPU mode engine 1 also leaves and rejoins 12 times within one version, its requests aborted and
    moved each time; and the engine preempts the first request of each prompt. None of it is a refusal, and the
    groups complete."""
    engine = _Engine(preempt=True)
    driver = _driver(engine, timeout_s=10, pool=EnginePool([0, 1]) if partial_gpu else None)
    try:
        driver.start()
        for _ in range(12):
            _wait_running(engine, 4)  # (k + 1) B groups x 2 samples
            if partial_gpu:
                driver.shrink([1])
                _wait_running(engine, 4)
                driver.expand([1])
        for _ in range(12):
            _wait_running(engine, 4)
            driver.begin_update()
            driver.finish_update()
        engine.serve()
        [group] = driver.take(1)
    finally:
        driver.close()
    assert [s.tokens for s in group.samples] == [[7], [7]] and driver.sched.version == 12
    assert driver._thread is not None and not driver._thread.is_alive()


def test_close_from_another_thread_ends_a_waiting_take_at_once() -> None:
    """Shutdown with requests in flight: a `take` waiting for groups that will never complete (the driver is closed
    and its thread gone) waited out `timeout_s` (an hour in a run) instead of raising."""
    engine = _Engine()
    driver = _driver(engine, timeout_s=8)
    trainer = InThread(lambda: driver.take(1))
    _wait_running(engine, 4)
    t0 = time.monotonic()
    driver.close()
    assert trainer.join(3) and time.monotonic() - t0 < 3
    assert isinstance(trainer.error, RuntimeError) and "closed" in str(trainer.error)
    with pytest.raises(RuntimeError, match="closed"):
        driver.take(1)


def test_groups_dropped_as_stale_leave_no_routing_home_behind() -> None:
    """Order "ready" drops the groups that outlive the bound at each update; in partial-GPU mode the homes of
    their samples (sticky routing) were never forgotten: the pool's table grew by group_size entries per dropped
    group, run-long. It holds at most the samples in flight."""
    engine = _Engine()
    pool = EnginePool([0, 1])
    prompts = iter(range(10**6))
    sched = RolloutScheduler(batch_groups=1, group_size=2, max_new_tokens=4, async_ratio=1, order="ready")
    driver = AsyncRollout(engine, sched, lambda: ("p", [next(prompts)]), SamplingParams(max_new_tokens=4), pool=pool)
    try:
        driver.start()
        for _ in range(10):
            _wait_running(engine, 4)
            driver.begin_update()
            driver.finish_update()
        _wait_running(engine, 4)
        # every group admitted before version 9 (two at version 0, one per version after) outlived the bound
        assert sched.counters["stale_groups"] == 10
        assert len(pool._home) <= sched.in_flight() * sched.group_size == 4
    finally:
        driver.close()


def _driver_of(engine: _Engine, sched: RolloutScheduler, timeout_s: float) -> AsyncRollout:
    prompts = iter(range(10**6))
    params = SamplingParams(max_new_tokens=4)
    return AsyncRollout(engine, sched, lambda: ("p", [next(prompts)]), params, timeout_s=timeout_s)


def test_a_take_that_times_out_gives_back_the_groups_it_had_taken() -> None:
    """The wait for a batch's last group timed out: the complete groups taken meanwhile were lost (the trainer got
    an exception, the scheduler no longer held them and booked them as trained), so a retried take waited for
    groups that did not exist any more and timed out again. They are given back and the retry returns them."""
    engine = _Engine()
    sched = RolloutScheduler(batch_groups=2, group_size=1, max_new_tokens=4, async_ratio=0)
    driver = _driver_of(engine, sched, timeout_s=0.3)
    try:
        driver.start()
        _wait_running(engine, 2)  # groups 0 and 1 (prompts [0] and [1]): the whole budget at k = 0
        engine.finish(0)
        with pytest.raises(TimeoutError, match="1 of 2 groups complete"):
            driver.take(2)
        assert sched.complete() == 1 and list(sched.groups) == [0, 1] and not sched._taken
        engine.finish(1)
        driver.timeout_s = 10.0  # only the first wait is meant to time out
        assert [g.gid for g in driver.take(2)] == [0, 1]
    finally:
        driver.close()


def test_a_batch_taken_over_several_waits_is_returned_oldest_first() -> None:
    """Order "ready" takes the groups that complete first; a batch gathered over two waits came back with the
    newer group first, though `take` promises the oldest first."""
    engine = _Engine()
    sched = RolloutScheduler(batch_groups=2, group_size=1, max_new_tokens=4, async_ratio=0, order="ready")
    driver = _driver_of(engine, sched, timeout_s=10)
    try:
        driver.start()
        _wait_running(engine, 2)
        engine.finish(1)
        trainer = InThread(lambda: [g.gid for g in driver.take(2)])
        deadline = time.monotonic() + 5
        while not sched._taken and time.monotonic() < deadline:  # group 1 taken, group 0 still running
            time.sleep(0.002)
        engine.finish(0)
        assert trainer.join(5)
    finally:
        driver.close()
    assert trainer.error is None and trainer.result == [0, 1]


class _StuckHandle:
    """A request handle whose `done()` does not return until `release` is set (a remote poll that hangs)."""

    def __init__(self, release: threading.Event, entered: threading.Event) -> None:
        self.release, self.entered = release, entered

    def done(self) -> bool:
        self.entered.set()
        self.release.wait()
        return False


def test_a_close_that_outlives_its_wait_warns_naming_the_thread_and_where_it_is_stuck(caplog) -> None:
    """close() joined the thread for 30 s and said nothing when it was still alive (left running, silently)."""
    release, entered = threading.Event(), threading.Event()
    engine = _Engine()
    engine.submit_request = lambda request, rank=None: _StuckHandle(release, entered)  # type: ignore[method-assign]
    driver = _driver(engine, timeout_s=5)
    driver.close_timeout_s = 0.2
    timer = threading.Timer(3.0, release.set)  # the thread ends after that (the old close waited it out, silent)
    timer.start()
    try:
        driver.start()
        assert entered.wait(5)
        with caplog.at_level("WARNING", logger="roll_core.scheduling.driver"):
            driver.close()
    finally:
        release.set()
        timer.cancel()
    (record,) = [r for r in caplog.records if "still alive" in r.getMessage()]
    assert record.getMessage().startswith(
        "async rollout: thread 'roll-async-rollout' still alive 0.2s after close() (left running, a daemon): polling "
        "the request handles and reading the finished ones' results; stuck in "
    )
    assert "done (test_async_driver.py:" in record.getMessage() and "_run (driver.py:" in record.getMessage()
    assert driver._thread is not None
    driver._thread.join(5)
    assert not driver._thread.is_alive()


def test_the_async_prompt_collector_closes_its_reward_model_too() -> None:
    """AsyncPromptCollector.close closed the driver only: the base's close (the reward model's) was skipped."""
    from roll_core.pipelines.collectors.prompts_async import AsyncPromptCollector

    closed: list[str] = []
    collector = AsyncPromptCollector.__new__(AsyncPromptCollector)  # only what close reads
    collector.driver = types.SimpleNamespace(close=lambda: closed.append("driver"))
    collector.reward_model = types.SimpleNamespace(close=lambda: closed.append("reward_model"))
    collector.close()
    assert closed == ["driver", "reward_model"]


def test_a_close_while_the_thread_is_being_started_waits_for_it_and_no_take_starts_one_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `close` from another thread (shutdown) while `take` was starting the thread: `start` had created it and
    close joined it before it was started (RuntimeError); a `take` after `close` started a thread nothing joined.
    Now `start` runs under the driver's lock and never after `close`."""
    created, go = threading.Event(), threading.Event()

    class _SlowStart(threading.Thread):
        def start(self) -> None:  # the driver's thread: the window between its creation and its start, held open
            if self.name == "roll-async-rollout":
                created.set()
                go.wait(5)
            super().start()

    monkeypatch.setattr(threading, "Thread", _SlowStart)
    engine = _Engine()
    driver = _driver(engine, timeout_s=5)
    starter = InThread(driver.start)
    assert created.wait(5)
    closer = InThread(driver.close)

    # close is called while the thread is created and not yet started: it waits for the lock `start` holds (a fixed
    # sleep here was too short on a loaded CI machine: close came after the thread had started and run)
    def in_close() -> bool:
        frame = sys._current_frames().get(closer._thread.ident)
        while frame is not None and frame.f_code.co_name != "close":
            frame = frame.f_back
        return frame is not None

    deadline = time.monotonic() + 5
    while not in_close() and not closer.join(0):  # (ended already: the old driver's close did not wait)
        assert time.monotonic() < deadline, "close was not called"
        time.sleep(0.005)
    time.sleep(0.05)  # (inside close: its first statement takes the lock)
    go.set()
    assert starter.join(5) and closer.join(5)
    assert starter.error is None and closer.error is None, closer.error
    assert driver._thread is not None
    driver._thread.join(5)
    # Which of close and the new thread takes the lock first is up to the scheduler (Python's locks are not fair):
    # the thread may have submitted its first requests before close; close aborts them, so none is left running.
    assert not driver._thread.is_alive() and not engine.running

    later = _driver(engine, timeout_s=5)
    later.close()
    with pytest.raises(RuntimeError, match="closed"):
        later.take(1)
    assert later._thread is None  # no thread started after close


def _group(gid: int, tokens: list[list[int]], mm: object) -> GroupState:
    """A complete group of samples with these tokens (version 0), for a problem named p<gid>."""
    problem = types.SimpleNamespace(answer="", id=f"p{gid}", prompt="q")
    group = GroupState(gid, problem, [3, 4], 0, mm=mm)
    group.samples = [
        SampleState(group, i, [Segment(t, [-0.1] * len(t), 0)], finish="stop") for i, t in enumerate(tokens)
    ]
    group.finished = len(tokens)
    return group


def test_the_async_prompt_collector_counts_every_take_as_the_sync_one_counts_every_round() -> None:
    """Dynamic sampling drops group 0 (no reward variance) and a second take replaces it. The step's reward counters
    were the first take's only (`reward/rows` 4 of 6 scored, `reward/failed_rows` 1 of 2), the rollout's tokens
    the trained groups' only (the dropped group's 6 were generated too), and `assemble`'s counts were not kept at
    all (a vision-language run's `data/picture_token_cuts`: here group 0 sampled a picture placeholder)."""
    from roll_core.pipelines.collectors.prompts_async import AsyncPromptCollector
    from roll_core.pipelines.metrics import StepLog

    picture = 9  # the tokenizer's <|image_pad|>
    tokenizer = types.SimpleNamespace(
        pad_token_id=0,
        unk_token_id=None,
        convert_tokens_to_ids=lambda name: picture if name == "<|image_pad|>" else None,
    )
    mm = types.SimpleNamespace(without_images=lambda: "pixels")
    takes = [
        [_group(0, [[5, picture, 5], [5, 5, 5]], mm), _group(1, [[6, 6], [6, 6]], mm)],
        [_group(2, [[7] * 4] * 2, mm)],
    ]
    scores = [
        ([1.0, 1.0, 1.0, 0.0], {"rows": 4, "failed_rows": 1}),  # group 0 uniform: dropped
        ([0.0, 1.0], {"rows": 2, "failed_rows": 1}),
    ]

    class _Driver:
        def __init__(self) -> None:
            self.discarded: list[int] = []

        def take(self, n: int) -> list[GroupState]:
            return takes.pop(0)

        def discard(self, group: GroupState) -> None:
            self.discarded.append(group.gid)

        def held(self) -> Any:
            return contextlib.nullcontext()

        def stats(self) -> dict[str, float]:
            return {}

    class _Reward:
        def score(self, batch: Batch) -> Batch:
            s, counters = scores.pop(0)
            s = torch.tensor(s)
            out = Batch({"scores": s, "correct": s, "formatted": torch.ones_like(s)}, {"response_text": [""] * len(s)})
            out.meta["reward_counters"] = counters
            return out

    c = AsyncPromptCollector.__new__(AsyncPromptCollector)  # what `next` reads
    algo = types.SimpleNamespace(
        group_size=2, drop_uniform_groups=True, refill_max_batches=2.0, overlong_buffer=0, reward_clip=None
    )
    model = types.SimpleNamespace(max_response_length=8)
    c.cfg = types.SimpleNamespace(algo=algo, model=model, pipeline=types.SimpleNamespace(rollout_batch_size=2))
    c.ctx, c.tokenizer = types.SimpleNamespace(samples=lambda step, rows: None), tokenizer
    c.task = types.SimpleNamespace(messages=lambda problem: [], skipped_rows={})
    c.driver, c.sched, c.k, c._handed, c._last_batch_at = _Driver(), types.SimpleNamespace(version=0), 1, [], None
    c.skipped_long = c.skipped_context = c.skipped_bad_images = 0
    c.processor, c.sampling, c.sampler = object(), SamplingParams(), types.SimpleNamespace(progress=lambda: 0.0)
    c.reward, c.reward_budget, c._step_counters, c._step_failure = _Reward(), RewardFailureBudget(3), {}, None
    c.reward_model, c.domains, c.advantage_scale = None, [], None

    out = StepLog()
    collected = c.next(1, out)
    assert [p for p in collected.batch["problem_id"]] == ["p1", "p1", "p2", "p2"] and c.driver.discarded == [0]
    assert (out["data/sampled_groups"], out["data/dropped_groups"], out["data/refill_rounds"]) == (3, 1, 1)
    assert (out["reward/rows"], out["reward/failed_rows"]) == (6.0, 2.0)
    assert out.get("perf/rollout_tokens") == 6 + 4 + 8
    assert out["perf/rollout_tokens_per_s"] == pytest.approx(18 / out.timers["generate"])
    assert out.get("data/picture_token_cuts") == 1
