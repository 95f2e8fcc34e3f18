"""The async rollout driver's data thread (roll_core.scheduling._driver_data) and what waits for it: the first failure
of the driver's two threads is the one the trainer sees; a data source that returns no group or runs dry fails the
rollout naming it and gives its group's reserved budget back; a scheduler `start` that raises keeps its reservation;
the asynchronous prompts collector's `next` does not wait for a blocked `next_group` and its `state_dict` gives up
on one after the driver's `timeout_s`, naming it. Fake engines, no Ray, no fixed sleeps."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from roll_core.cluster.reward_guard import RewardFailureBudget
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.collectors.prompts_async import AsyncPromptCollector
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.held_requests import HeldRequestEngine
from roll_core.testing.threads import InThread

WITHIN_S = 60  # generous: a loaded machine may take seconds to schedule a thread
HOLD_S = 3 * WITHIN_S  # how long a blocked call waits for its release at most (the test's waits end first)


class _Data:
    """`next_group`: problem i with prompt [i], for i = 0, 1, ...; the draw of `block_at` waits for `release` (`entered`
    says it began), then returns its group, or raises `error` when set. `before(i)` runs before each draw returns."""

    def __init__(self, block_at: int, before: Callable[[int], None] | None = None) -> None:
        self.block_at, self.before = block_at, before
        self.entered, self.release = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.problems = [types.SimpleNamespace(answer="", id=f"p{i}", prompt="q") for i in range(8)]
        self.drawn = 0

    def next_group(self) -> tuple:
        i, self.drawn = self.drawn, self.drawn + 1
        if i == self.block_at:
            self.entered.set()
            self.release.wait(HOLD_S)
            if self.error is not None:
                raise self.error
        if self.before is not None:
            self.before(i)
        return (self.problems[i], [i])


def _engine() -> HeldRequestEngine:
    return HeldRequestEngine(abort_tokens=[7], serve_tokens=[5, 6])


def _driver(engine: HeldRequestEngine, next_group: Callable[[], Any], group_size: int = 1, **kw: Any) -> AsyncRollout:
    # (k + 1) B = 2 groups
    sched = RolloutScheduler(batch_groups=1, group_size=group_size, max_new_tokens=8, async_ratio=1)
    return AsyncRollout(engine, sched, next_group, SamplingParams(max_new_tokens=8), **kw)


def test_the_first_failure_is_kept_when_the_data_source_fails_after_the_engine() -> None:
    """Group 0's request fails in the engine while the draw of group 1 blocks; the trainer's take raises the engine's
    failure. Then the data source, released, raises too (a dataloader torn down by the failure, say). The data
    thread's error replaced the engine's: the trainer's next call raised another cause than its first. Now the
    first failure stays, and both threads end."""
    data = _Data(block_at=1)
    engine = _engine()
    driver = _driver(engine, data.next_group, timeout_s=WITHIN_S)
    try:
        driver.start()
        assert data.entered.wait(WITHIN_S)
        assert engine.wait_running(1) == ["async-0"]
        engine.fail(ConnectionError("engine worker died"))
        with pytest.raises(RuntimeError, match=r"async-0 .*failed in the inference engine.*engine worker died"):
            driver.take(1)
        data.error = ValueError("dataloader torn down")
        data.release.set()
        for thread in (driver._thread, driver._feeder):
            assert thread is not None
            thread.join(WITHIN_S)
            assert not thread.is_alive()
        with pytest.raises(RuntimeError, match=r"failed in the inference engine.*engine worker died"):
            driver.take(1)
        assert driver.sched._reserved == 0 and driver.sched.capacity() == 1  # group 1's budget given back
    finally:
        data.release.set()
        driver.close()
        engine.release()


def _raises_stop() -> tuple:
    raise StopIteration


@pytest.mark.parametrize(
    ("next_group", "says"),
    [
        (lambda: None, "returned None: expected (payload, prompt ids) or (payload, prompt ids, pictures)"),
        (lambda: ("p", None), "returned the prompt ids None: expected token ids, in (payload, prompt ids)"),
        (lambda: ("p", "1 2 3"), "returned the prompt ids '1 2 3': expected token ids"),
        (_raises_stop, "_raises_stop raised StopIteration:  (an exhausted data iterator?)"),
    ],
    ids=["none", "no-prompt-ids", "text-prompt", "exhausted"],
)
def test_a_data_source_that_returns_no_group_fails_naming_itself_and_gives_the_budget_back(
    next_group: Callable[[], Any], says: str
) -> None:
    """The first draw returns something that is not a group, or raises a bare StopIteration (an exhausted iterator).
    The trainer read "cannot unpack non-iterable NoneType object", "'NoneType' object is not iterable" (and the
    group's reserved budget was used up by a group never started), a group of one prompt per character, or
    "async rollout failed: " with no reason. Now the take raises an error naming the data source and what it
    returned; the reservation is given back and the data thread ends."""
    engine = _engine()
    driver = _driver(engine, next_group, timeout_s=WITHIN_S)
    try:
        with pytest.raises(RuntimeError, match="async rollout failed") as err:
            driver.take(1)
        assert says in str(err.value), str(err.value)
        assert driver._feeder is not None
        driver._feeder.join(WITHIN_S)
        assert not driver._feeder.is_alive()
        assert driver.sched._reserved == 0 and driver.sched.capacity() == 2
        assert driver.sched.counters["started_groups"] == 0 and engine.requests == []
    finally:
        driver.close()
        engine.release()


def test_a_start_on_a_reservation_that_raises_keeps_the_reservation() -> None:
    """`start(reserved=True)` with prompt ids that are not a sequence raised after it used up the reservation: the
    budget stayed booked for a group that never started, and `unreserve` refused to give it back."""
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=0)
    s.reserve()
    with pytest.raises(TypeError):
        s.start("p", None, reserved=True)  # type: ignore[arg-type]
    assert s.counters["started_groups"] == 0 and not s.groups
    s.unreserve()
    assert s.capacity() == 1


class _Reward:
    def score(self, batch: Batch) -> Batch:
        s = torch.tensor([0.0, 1.0])
        out = Batch({"scores": s, "correct": s, "formatted": torch.ones_like(s)}, {"response_text": [""] * 2})
        out.meta["reward_counters"] = {"rows": 2}
        return out


def _collector(driver: AsyncRollout, data: _Data) -> AsyncPromptCollector:
    """An asynchronous prompts collector over `driver` (groups of 2), with what `next` and `state_dict` read."""
    c = AsyncPromptCollector.__new__(AsyncPromptCollector)
    algo = types.SimpleNamespace(group_size=2, drop_uniform_groups=False, overlong_buffer=0, reward_clip=None)
    pipeline = types.SimpleNamespace(rollout_batch_size=1)
    c.cfg = types.SimpleNamespace(algo=algo, model=types.SimpleNamespace(max_response_length=8), pipeline=pipeline)
    c.ctx = types.SimpleNamespace(samples=lambda step, rows: None)
    c.tokenizer = types.SimpleNamespace(pad_token_id=0, unk_token_id=None, convert_tokens_to_ids=lambda name: None)
    c.task = types.SimpleNamespace(messages=lambda problem: [], skipped_rows={})
    c.driver, c.sched, c.k, c._handed, c._last_batch_at = driver, driver.sched, 1, [], None
    c.skipped_long = c.skipped_context = c.skipped_bad_images = 0
    c.processor, c.sampling = None, SamplingParams()
    c.sampler = types.SimpleNamespace(progress=lambda: 0.0, state_dict=dict, load_state_dict=lambda state: None)
    c.reward, c.reward_budget, c._step_counters, c._step_failure = _Reward(), RewardFailureBudget(3), {}, None
    c.reward_model, c.domains, c.advantage_scale, c._replay = None, [], None, []
    c._index = {id(p): i for i, p in enumerate(data.problems)}
    c._data_fingerprint = "data"
    return c


def test_the_collectors_next_returns_while_next_group_blocks() -> None:
    """Group 0 is generated; the draw of group 1 blocks (its data source counted a prompt skipped as too long before
    it). `next` read the skip counts with the driver held, which waits for the draw: the trainer's step stalled
    after its take for as long as the data source blocked. Now it returns the batch, the skip counted."""
    holder: list[AsyncPromptCollector] = []

    def skip_one(i: int) -> None:
        if i == 0:
            holder[0].skipped_long += 1  # (before the draw that blocks: no other thread counts meanwhile)

    data = _Data(block_at=1, before=skip_one)
    engine = _engine()
    driver = _driver(engine, data.next_group, group_size=2, timeout_s=WITHIN_S)
    holder.append(_collector(driver, data))
    try:
        driver.start()
        assert data.entered.wait(WITHIN_S)
        engine.wait_running(2)
        engine.serve()
        out = StepLog()
        step = InThread(lambda: holder[0].next(1, out))
        assert step.join(WITHIN_S), "next waited for the blocked next_group"
        assert step.error is None, step.error
        assert step.result is not None and list(step.result.batch["problem_id"]) == ["p0", "p0"]
        assert out["data/skipped_long_prompts"] == 1 and holder[0].skipped_long == 0
    finally:
        data.release.set()
        driver.close()
        engine.release()


def test_the_collectors_state_dict_gives_up_on_a_blocked_next_group_naming_it() -> None:
    """The draw of group 1 blocks when the trainer saves a checkpoint. `state_dict` waited for it without limit (a
    stuck data source hung the run, silently). Now it raises a TimeoutError after the driver's `timeout_s`, naming
    the data source and how long it has blocked; once the data comes, the checkpoint lists both groups as pending."""
    data = _Data(block_at=1)
    engine = _engine()
    driver = _driver(engine, data.next_group, group_size=2, timeout_s=0.3)
    c = _collector(driver, data)
    try:
        driver.start()
        assert data.entered.wait(WITHIN_S)
        save = InThread(c.state_dict)
        assert save.join(WITHIN_S), "state_dict waited for the blocked next_group without limit"
        assert isinstance(save.error, TimeoutError), save.error
        msg = str(save.error)
        assert "held() gave up after 0.3 s (pipeline.async_batch_timeout_s) waiting for the data thread" in msg, msg
        assert "the data source _Data.next_group has not returned a group for " in msg, msg
        data.release.set()
        driver.timeout_s = WITHIN_S
        deadline_groups = InThread(lambda: _wait_started(driver, 2))
        assert deadline_groups.join(WITHIN_S) and deadline_groups.error is None, deadline_groups.error
        assert c.state_dict()["pending"] == [0, 1]
    finally:
        data.release.set()
        driver.close()
        engine.release()


def _wait_started(driver: AsyncRollout, n: int) -> None:
    """Wait (the driver's condition, woken by its threads, with a short poll) until `n` groups have started."""
    with driver._cv:
        while driver.sched.counters["started_groups"] < n:
            driver._cv.wait(0.05)
