"""The agent collector's session ids (pipeline=agent) stay unique for the run across a resume: the count of episodes
run is the collector's checkpointed state, so the resumed process's first episode is not `ep0` again (the ids reach
the agent program's URLs and logs: a program keeping per-session state, or logs joined across the resume, mixed two
episodes). No engine, no Ray: a request API that answers at once and a program that asks one question."""

from __future__ import annotations

import json
import logging
import re
import threading
import urllib.request
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer


class _Answering:
    """The request API, answering every request at once with two tokens."""

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [5, 6], [-0.5, -0.5], "stop"))
        return fut

    def abort(self, request_id: str) -> bool:
        return False

    def check_sampling(self, params: SamplingParams) -> None:
        return None


class _Task:
    """An agent-program task whose program asks one question and returns 1.0; `sessions`: the session ids its
    programs were given (read from their base URLs)."""

    is_agent_program = True
    name = "one_question"
    max_turns, max_tokens_per_turn, max_context_length = 2, 4, 256
    episode_timeout_s = 30.0
    tool_parser, on_rewrite, on_failure = "none", "restart", "score"
    failure_reward, success_reward, model_name = 0.0, 1.0, "roll"

    def __init__(self) -> None:
        self.chat_template_kwargs: dict[str, Any] = {}
        self.sessions: list[str] = []
        self._lock = threading.Lock()

    def train_rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        return [{"id": i} for i in range(count)]

    def eval_rows(self) -> list[dict[str, Any]]:
        return [{"id": 0}, {"id": 1}]

    def run_episode(self, base_url: str, reward_url: str, row: dict[str, Any]) -> float | None:
        sid = re.fullmatch(r".*/sessions/([^/]+)/v1", base_url).group(1)  # type: ignore[union-attr]
        with self._lock:
            self.sessions.append(sid)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"task {row['id']}"}]}).encode()
        req = urllib.request.Request(
            f"{base_url}/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
        return 1.0


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def _collector(task: _Task, tokenizer: Any) -> Any:
    from roll_core.pipelines.collectors import CollectorContext
    from roll_core.pipelines.collectors.agents import agent_collectors

    pipe = SimpleNamespace(
        seed=0, rollout_batch_size=2, async_ratio=0, eval_temperature=0.0, async_abort_timeout_s=60.0, max_idle_aborts=8
    )
    cfg = SimpleNamespace(pipeline=pipe, algo=SimpleNamespace(group_size=2), model=SimpleNamespace())
    cfg.model.chat_template_kwargs = {}
    ctx = CollectorContext(cfg, None, _Answering(), SamplingParams(max_new_tokens=4), tokenizer, task, "tiny")
    agent_collectors.check(cfg, task)
    return agent_collectors(ctx)


def _restore(collector: Any, saved: dict[str, Any]) -> None:
    """What the loop does with a checkpoint's collector state (Pipeline._restore), after its JSON round trip."""
    state = json.loads(json.dumps(saved))
    if state or collector.state_dict():
        collector.load_state_dict(state)


def test_session_ids_continue_after_a_resume(tokenizer: Any) -> None:
    """Step 1 and its evaluation ran ep0..ep5 and were checkpointed; the resumed process's step 2 ran ep0..ep3
    again (the ids restarted)."""
    from roll_core.pipelines.metrics import StepLog

    first = _Task()
    collector = _collector(first, tokenizer)
    try:
        assert collector.next(1, StepLog()) is not None
        collector.evaluate(1)
        saved = collector.state_dict()
    finally:
        collector.close()
    assert sorted(first.sessions) == [f"ep{i}" for i in range(6)]

    resumed = _Task()
    collector = _collector(resumed, tokenizer)
    try:
        _restore(collector, saved)
        assert collector.next(2, StepLog()) is not None
    finally:
        collector.close()
    assert sorted(resumed.sessions) == [f"ep{i}" for i in range(6, 10)]


def test_a_checkpoint_without_the_count_restarts_the_ids_with_a_warning_and_a_bad_count_is_refused(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    collector = _collector(_Task(), tokenizer)
    try:
        with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.collectors.agents"):
            collector.load_state_dict({})  # a checkpoint of roll before the count was saved
        assert "session ids restart at ep0" in caplog.text and collector.state_dict() == {"episodes": 0}
        for bad in (-1, "3", 2.5, True):
            with pytest.raises(ValueError, match="agent session count"):
                collector.load_state_dict({"episodes": bad})
    finally:
        collector.close()
