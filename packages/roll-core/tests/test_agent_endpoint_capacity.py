"""The agent endpoint (pipeline=agent) under a step's load and at its edges: every episode of a step reaches the
engine at once, however many (the server's threads are sized from the run's concurrency, not a fixed 256), text
content parts are joined as vLLM's OpenAI server joins them, and closing the collector releases what its task holds.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.agentic.agent_sessions import AgentSessions, SessionLimits, normalise_message
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import NoToolParser, OpenAIServer
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def _chat(base_url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = json.dumps({"model": "m", "messages": messages}).encode()
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(f"{base_url}/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


class _AllAtOnce:
    """The request API answering only once `n` requests are in flight together (an abort answers its own): an
    engine whose batch is the whole step, like vLLM's with max_num_seqs covering it. `peak`: the most at once."""

    def __init__(self, n: int) -> None:
        self.n, self.peak, self.prompts = n, 0, []
        self._waiting: dict[str, tuple[Request, Future]] = {}
        self._lock = threading.Lock()

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        fut: Future = Future()
        with self._lock:
            self.prompts.append(list(request.prompt_ids))
            self._waiting[request.request_id] = (request, fut)
            self.peak = max(self.peak, len(self._waiting))
            ready = list(self._waiting.values()) if len(self._waiting) >= self.n else []
            if ready:
                self._waiting.clear()
        for req, f in ready:
            f.set_result(RequestOutput(req.request_id, req.prompt_ids, [5, 6], [-0.5, -0.5], "stop"))
        return fut

    def abort(self, request_id: str) -> bool:
        with self._lock:
            held = self._waiting.pop(request_id, None)
        if held is not None:
            held[1].set_result(RequestOutput(request_id, held[0].prompt_ids, [], [], "abort"))
        return held is not None

    def check_sampling(self, params: SamplingParams) -> None:
        return None


class _Task:
    """An agent-program task whose program asks one question and returns 1.0."""

    is_agent_program = True
    name = "one_question"
    max_turns, max_tokens_per_turn, max_context_length = 2, 4, 256
    episode_timeout_s = 8.0
    tool_parser, on_rewrite, on_failure = "none", "restart", "score"
    failure_reward, success_reward, model_name = 0.0, 1.0, "roll"

    def __init__(self) -> None:
        self.chat_template_kwargs: dict[str, Any] = {}
        self.closed = 0

    def train_rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        return [{"id": i} for i in range(count)]

    def eval_rows(self) -> list[dict[str, Any]]:
        return [{"id": 0}]

    def run_episode(self, base_url: str, reward_url: str, row: dict[str, Any]) -> float | None:
        _chat(base_url, [{"role": "user", "content": f"task {row['id']}"}])
        return 1.0

    def close(self) -> None:
        self.closed += 1


def _collector(task: Any, infer: Any, tokenizer: Any, batch: int, group_size: int) -> Any:
    from roll_core.pipelines.collectors import CollectorContext
    from roll_core.pipelines.collectors.agents import agent_collectors

    pipe = SimpleNamespace(
        seed=0,
        rollout_batch_size=batch,
        async_ratio=0,
        eval_temperature=0.0,
        async_abort_timeout_s=60.0,
        max_idle_aborts=8,
    )
    cfg = SimpleNamespace(pipeline=pipe, algo=SimpleNamespace(group_size=group_size), model=SimpleNamespace())
    cfg.model.chat_template_kwargs = {}
    ctx = CollectorContext(cfg, None, infer, SamplingParams(max_new_tokens=4), tokenizer, task, "tiny")
    agent_collectors.check(cfg, task)
    return agent_collectors(ctx)


def test_every_episode_of_a_step_reaches_the_engine_at_once(tokenizer: Any) -> None:
    """65 rows x 4 = 260 episodes, more than the 256 threads the endpoint had: the last 4 requests waited for a
    thread, never reached the engine, and their episodes timed out (scored as failures)."""
    n = 65 * 4
    infer = _AllAtOnce(n)
    collector = _collector(_Task(), infer, tokenizer, batch=65, group_size=4)
    try:
        episodes = collector.run([({"id": i}, i) for i in range(n)], SamplingParams(max_new_tokens=4, seed=1))
    finally:
        collector.close()
    assert infer.peak == n
    assert [e.failure for e in episodes] == [None] * n and all(e.traj.turns == 1 for e in episodes)


def test_closing_the_collector_closes_its_task(tokenizer: Any) -> None:
    """The task's `close()` (roll_envs' openai_agent closes its programs' HTTP client there) is called: the client's
    keep-alive connections stayed open after the run."""
    task = _Task()
    collector = _collector(task, _AllAtOnce(1), tokenizer, batch=1, group_size=1)
    collector.close()
    assert task.closed == 1


def test_text_content_parts_are_joined_by_newlines_as_vllm_joins_them(tokenizer: Any) -> None:
    """vLLM's OpenAI server (chat_utils._parse_chat_message_content_parts) joins a message's text parts with "\\n"
    for a chat template taking string content: the prompt must tokenize as it would there (they were joined with
    ""), and a later request repeating the message as one string continues the same conversation."""
    parts = [{"type": "text", "text": "Task 3:"}, {"type": "text", "text": "say 7"}]
    assert normalise_message({"role": "user", "content": parts}, 0)["content"] == "Task 3:\nsay 7"
    infer = _AllAtOnce(1)
    sessions = AgentSessions(infer, TurnTemplate(tokenizer), tokenizer.decode, NoToolParser())
    server = OpenAIServer(sessions)
    server.start()
    try:
        for sid in ("parts", "string"):
            sessions.open(sid, SamplingParams(max_new_tokens=4), SessionLimits(max_context_length=256))
        reply = _chat(server.base_url("parts"), [{"role": "user", "content": parts}])
        _chat(server.base_url("string"), [{"role": "user", "content": "Task 3:\nsay 7"}])
        history = [{"role": "user", "content": "Task 3:\nsay 7"}, reply["choices"][0]["message"]]
        _chat(server.base_url("parts"), [*history, {"role": "user", "content": [{"type": "text", "text": "again"}]}])
        session = sessions.close("parts")
        sessions.close("string")
    finally:
        server.close()
    assert infer.prompts[0] == infer.prompts[1]  # the same prompt ids as the text sent as one string
    assert session.rewrites == 0 and session.traj.turns == 2


def test_a_run_level_constraint_is_refused_for_training_agents(tokenizer: Any) -> None:
    """infer_engine.structured constrains every turn the agents' requests sample, and the trainer cannot replay it over
    a multi-turn trajectory (a request's own response_format turn is context, mask 0): refused when training, as for
    pipeline=agentic; roll-eval (no train group) may sample under it."""
    from roll_core.errors import ConfigError
    from roll_core.pipelines.collectors import CollectorContext
    from roll_core.pipelines.collectors.agents import agent_collectors

    pipe = SimpleNamespace(
        seed=0,
        rollout_batch_size=1,
        async_ratio=0,
        eval_temperature=0.0,
        name="agent",
        async_abort_timeout_s=60.0,
        max_idle_aborts=8,
    )
    cfg = SimpleNamespace(pipeline=pipe, algo=SimpleNamespace(group_size=1), model=SimpleNamespace())
    cfg.model.chat_template_kwargs = {}
    cfg.infer_engine = SimpleNamespace(structured={"regex": "a+"})
    sampling = SamplingParams(max_new_tokens=4)
    train = CollectorContext(cfg, None, _AllAtOnce(1), sampling, tokenizer, _Task(), "tiny", train=object())
    with pytest.raises(ConfigError, match=r"infer_engine\.structured=.*pipeline=agent: .*per-turn constraint"):
        agent_collectors(train)
    agent_collectors(CollectorContext(cfg, None, _AllAtOnce(1), sampling, tokenizer, _Task(), "tiny")).close()
