"""pipeline=agent's collector and `pipeline.async_abort_timeout_s`: the key bounds how long a request aborted by its
session's close (an episode timeout) may take to answer (the collector built its `AgentSessions` without it: a fixed
60 s), and the requests given up that way reach the step's metrics (`async/unanswered_aborts`,
`async/failed_aborts`, the gate's `stats()`: they were counted but never logged); `pipeline.max_idle_aborts`: how many
times in a row the engine may abort a turn's request without a token before the agent gets 503 `engine_aborted`
(the sessions used the module's fixed 8). A real collector and endpoint on 127.0.0.1 with a fake engine, no Ray."""

from __future__ import annotations

import json
import threading
import urllib.request
from concurrent.futures import Future
from typing import Any

import pytest

from roll_core.config.compose import load_config
from roll_core.interfaces import Request, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors import CollectorContext
from roll_core.pipelines.collectors.agents import agent_collectors
from roll_core.pipelines.metrics import StepLog
from roll_core.testing.agent_endpoint import quick_idle_backoff
from roll_core.testing.held_requests import HeldRequestEngine


class _Engine:
    """Holds every request; an abort is never answered (`deaf`) or fails the request (`raise`)."""

    def __init__(self, on_abort: str) -> None:
        self.on_abort, self.submitted = on_abort, threading.Event()
        self.futures: dict[str, Future] = {}

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        fut: Future = Future()
        self.futures[request.request_id] = fut
        self.submitted.set()
        return fut

    def abort(self, request_id: str) -> bool:
        fut = self.futures.get(request_id)
        if self.on_abort == "raise" and fut is not None and not fut.done():
            fut.set_exception(ConnectionError("the engine's worker died"))
        return fut is not None

    def check_sampling(self, params: SamplingParams) -> None:
        return None

    def release(self) -> None:
        for fut in self.futures.values():
            if not fut.done():
                fut.set_exception(ConnectionError("test over"))


class _Task:
    """One agent program that asks one question and waits for its answer. The episode timeout fires once the
    engine holds the request (`armed`: the collector reads `episode_timeout_s` right before it waits), so the
    session always closes on a request in flight, however loaded the machine."""

    is_agent_program = True
    name = "one_question"
    max_turns, max_tokens_per_turn, max_context_length = 2, 4, 256
    tool_parser, on_rewrite, on_failure = "none", "restart", "score"
    failure_reward, success_reward, model_name = 0.0, 1.0, "roll"

    def __init__(self, engine: _Engine) -> None:
        self.engine, self.armed = engine, False
        self.chat_template_kwargs: dict[str, Any] = {}

    @property
    def episode_timeout_s(self) -> float:
        if self.armed:
            assert self.engine.submitted.wait(60), "the program's request never reached the engine"
        return 0.2

    def train_rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        return [{"id": i} for i in range(count)]

    def eval_rows(self) -> list[dict[str, Any]]:
        return [{"id": 0}]

    def run_episode(self, base_url: str, reward_url: str, row: dict[str, Any]) -> float | None:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(f"{base_url}/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:  # its 410 comes once the request is given up
            json.loads(resp.read())
        return 1.0


def _collector(engine: Any, abort_timeout_s: float, *overrides: str) -> Any:
    """pipeline=agent's collector over `engine`, built from the config with `overrides`."""
    cfg = load_config(
        [
            "pipeline=agent",
            "pipeline.rollout_batch_size=1",
            f"pipeline.async_abort_timeout_s={abort_timeout_s}",
            *overrides,
        ]
    )
    cfg.algo.group_size = 1
    task = _Task(engine)
    ctx = CollectorContext(cfg, None, engine, SamplingParams(max_new_tokens=4), build_tiny_tokenizer(), task, "t")
    agent_collectors.check(cfg, task)
    return agent_collectors(ctx)


def test_the_key_bounds_the_agent_sessions_aborts() -> None:
    collector = _collector(_Engine("deaf"), 7.5)
    try:
        assert collector.sessions.gate.abort_timeout_s == 7.5
    finally:
        collector.close()


@pytest.mark.parametrize("on_abort, lost", [("deaf", "async/unanswered_aborts"), ("raise", "async/failed_aborts")])
def test_a_request_given_up_after_its_episode_timed_out_is_in_the_step_metrics(on_abort: str, lost: str) -> None:
    """The episode times out on a request the engine holds; its abort is never answered (given up after the key's
    0.5 s, not 60 s) or fails: one request lost, counted in the step's metrics once."""
    engine = _Engine(on_abort)
    collector = _collector(engine, 0.5)
    collector.task.armed = True
    try:
        out = StepLog()
        assert collector.next(1, out) is None  # the one episode timed out before a turn was sampled
        assert out["agent/failed_timeout"] == 1.0
        other = ({"async/unanswered_aborts", "async/failed_aborts"} - {lost}).pop()
        assert (out[lost], out[other]) == (1.0, 0.0)
        assert collector.sessions.gate.stats() == {"async/unanswered_aborts": 0.0, "async/failed_aborts": 0.0}
    finally:
        engine.release()
        collector.close()


@pytest.mark.parametrize("n", [3, 11])
def test_max_idle_aborts_decides_when_a_turn_is_refused(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that aborts every request itself, without a token: the session built from
    `pipeline.max_idle_aborts=N` refuses the turn (503 engine_aborted, naming the key) at the N-th abort in a row."""
    from roll_core.agentic.agent_sessions import ChatTurn, SessionError

    quick_idle_backoff(monkeypatch)  # the waits between tries are not this test's subject
    engine = HeldRequestEngine(abort_tokens=[], serve_tokens=[5], preempt=lambda request: True)
    collector = _collector(engine, 60.0, f"pipeline.max_idle_aborts={n}")
    try:
        collector.sessions.open("s", SamplingParams(max_new_tokens=4), collector.limits)
        with pytest.raises(SessionError) as err:
            collector.sessions.chat("s", ChatTurn(messages=[{"role": "user", "content": "hi"}]))
        assert (err.value.status, err.value.code, len(engine.requests)) == (503, "engine_aborted", n)
        assert f"aborted {n} times in a row without a token, the run's pipeline.max_idle_aborts" in str(err.value)
    finally:
        engine.release()
        collector.close()
