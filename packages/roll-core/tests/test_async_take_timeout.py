"""AsyncRollout.take's timeout (roll_core.scheduling.driver): the error names the config key that sets the wait
(`pipeline.async_batch_timeout_s`), the unfinished groups with their samples left, and the requests still running,
as the agentic collector's batch timeout does. A fake engine that answers only what the test finishes; no Ray."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future

import pytest

from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.scheduler import RolloutScheduler


class _Engine:
    """Requests run until `finish(prompt)` (one token, `stop`); an abort answers at once with no token."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, tuple[Request, Future]] = {}

    def submit_request(self, request: Request, rank: int | None = None) -> Future:
        fut: Future = Future()
        with self.lock:
            self.running[request.request_id] = (request, fut)
        return fut

    def abort(self, request_id: str) -> bool:
        with self.lock:
            item = self.running.pop(request_id, None)
        if item is not None:
            item[1].set_result(RequestOutput(request_id, item[0].prompt_ids, [], [], "abort"))
        return item is not None

    def finish(self, prompt: int) -> None:
        with self.lock:
            done = [rid for rid, (req, _) in self.running.items() if req.prompt_ids[0] == prompt]
            items = [self.running.pop(rid) for rid in done]
        for req, fut in items:
            fut.set_result(RequestOutput(req.request_id, req.prompt_ids, [8], [-0.5], "stop"))

    def of_prompt(self, prompt: int) -> list[str]:
        with self.lock:
            return [rid for rid, (req, _) in self.running.items() if req.prompt_ids[0] == prompt]


def _wait(cond: object, what: str) -> None:
    deadline = time.monotonic() + 60
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_a_take_that_times_out_names_the_config_key_the_unfinished_groups_and_the_running_requests() -> None:
    """Group 0 (prompt [0]) completes, group 1 (prompt [1], two samples) hangs in the engine: the error said
    "1 of 2 groups complete after 0.3s (1 running)", naming neither the setting to raise nor what it waited for.
    Nothing aborts a request the engine never answers, so this timeout is its only bound: the error also says how
    long each request has run (the named ones ran through the whole wait), which tells a hung one from a slow
    batch (it named the requests only)."""
    engine = _Engine()
    sched = RolloutScheduler(batch_groups=2, group_size=2, max_new_tokens=4, async_ratio=0)
    prompts = iter(range(10**6))
    driver = AsyncRollout(
        engine, sched, lambda: ("p", [next(prompts)]), SamplingParams(max_new_tokens=4), timeout_s=0.3
    )
    try:
        driver.start()
        _wait(lambda: len(engine.running) == 4, "the 4 requests of groups 0 and 1 running")
        hung = engine.of_prompt(1)
        engine.finish(0)
        _wait(lambda: sched.complete() == 1, "group 0 complete")
        with pytest.raises(TimeoutError) as err:
            driver.take(2)
    finally:
        driver.close()
    match = re.fullmatch(
        re.escape(
            "async rollout: 1 of 2 groups complete after 0.3s (pipeline.async_batch_timeout_s): 1 group(s) unfinished: "
            f"1 (2 of 2 left); 2 request(s) running (oldest first, time since submitted): {hung[0]} (AGE s), "
            f"{hung[1]} (AGE s); requests running without finishing (a hung or slow inference engine?)"
        ).replace("AGE", r"(\d+\.\d)"),
        str(err.value),
    )
    assert match is not None, str(err.value)
    assert all(float(age) >= 0.3 for age in match.groups()), str(err.value)


def test_a_take_starved_of_budget_says_so_and_names_async_ratio_not_a_hung_engine() -> None:
    """A take of more groups than the budget lets start before the next weight update (B = 1, async_ratio 0, take
    of 2): nothing runs, yet the error blamed "a hung inference engine?"; it says the groups never started for lack
    of budget and names pipeline.async_ratio."""
    engine = _Engine()
    sched = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=0)
    prompts = iter(range(10**6))
    driver = AsyncRollout(
        engine, sched, lambda: ("p", [next(prompts)]), SamplingParams(max_new_tokens=4), timeout_s=0.3
    )
    try:
        driver.start()
        _wait(lambda: len(engine.running) == 1, "the request of group 0 running")
        engine.finish(0)
        _wait(lambda: sched.complete() == 1, "group 0 complete")
        with pytest.raises(TimeoutError) as err:
            driver.take(2)
    finally:
        driver.close()
    assert str(err.value) == (
        "async rollout: 1 of 2 groups complete after 0.3s (pipeline.async_batch_timeout_s): 0 group(s) unfinished: "
        "none; 0 request(s) running: none; 1 group(s) never started for lack of budget: the scheduler's budget "
        "(pipeline.async_ratio=0: at most 0 + 1 batches of 1 groups ahead of the trainer) is all started at version "
        "0, and no group starts before the next weight update (take at most a batch per version, or raise "
        "pipeline.async_ratio)"
    )
