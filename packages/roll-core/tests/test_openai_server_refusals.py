"""The OpenAI-compatible endpoint's refusals, over HTTP on 127.0.0.1: an engine that refuses a turn (503) leaves the
episode untrained instead of training the refusal as the policy's failure; a chat template that refuses the
messages is the request's 400, not a 500 clients retry; malformed sampling fields and the legacy `functions` are
400s, not silently answered 200s; closing the server ends the requests in flight instead of hanging on them."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from roll_core.agentic.agent_sessions import (
    MAX_IDLE_ABORTS,
    AgentSessions,
    ChatTurn,
    SessionError,
    SessionLimits,
    idle_backoff_s,
    idle_backoff_total_s,
)
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import HermesToolParser, OpenAIServer
from roll_core.agentic.trajectory import to_tensors
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.metrics import StepLog
from roll_core.testing.agent_endpoint import gives_up_on_refusal, quick_idle_backoff, serve
from roll_core.testing.held_requests import threads_left

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
LIMITS = SessionLimits(max_turns=4, max_tokens_per_turn=16, max_context_length=1024)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


class RefusingEngine:
    """Answers "ok" (then EOS), except that requests number `refuse_from` .. `refuse_from + refusals - 1` (0-based)
    are aborted with no token, as an overloaded engine refuses them; `aborted`: the ids `abort` was called with."""

    def __init__(self, tokenizer: Any, refuse_from: int, refusals: int) -> None:
        self.tokenizer, self.refuse_from, self.refusals = tokenizer, refuse_from, refusals
        self.requests: list[Request] = []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        k = len(self.requests)
        self.requests.append(request)
        fut: Future = Future()
        if self.refuse_from <= k < self.refuse_from + self.refusals:
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "abort"))
        else:
            ids = self.tokenizer("ok", add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.25] * len(ids), "stop"))
        return fut

    def abort(self, request_id: str) -> bool:
        return False

    def check_sampling(self, params: SamplingParams) -> None:
        return None


class HangingEngine(RefusingEngine):
    """Never answers a request until it is aborted (an engine that stopped, or a turn that runs long)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, 0, 0)
        self.pending: dict[str, tuple[Request, Future]] = {}
        self.aborted: list[str] = []
        self.submitted = threading.Event()

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.requests.append(request)
        fut: Future = Future()
        self.pending[request.request_id] = (request, fut)
        self.submitted.set()
        return fut

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        held = self.pending.pop(request_id, None)
        if held is not None:
            held[1].set_result(RequestOutput(request_id, held[0].prompt_ids, [], [], "abort"))
        return held is not None


def _serve(infer: Any, tokenizer: Any) -> tuple[AgentSessions, OpenAIServer]:
    sessions, server = serve(infer, tokenizer)
    assert server.url.startswith("http://127.0.0.1:")
    return sessions, server


def _post(url: str, body: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _collector(sessions: AgentSessions, server: OpenAIServer, run_episode: Any) -> Any:
    from roll_core.pipelines.collectors.agents import AgentCollector

    c = AgentCollector.__new__(AgentCollector)  # the episode part only, on the real server
    c.sessions, c.server, c.limits = sessions, server, LIMITS
    c.task = SimpleNamespace(run_episode=run_episode, episode_timeout_s=20.0, failure_reward=-1.0, success_reward=1.0)
    return c


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    quick_idle_backoff(monkeypatch)


@pytest.mark.usefixtures("quick_backoff")
def test_an_engine_refusal_is_a_503_and_leaves_the_episode_untrained(tokenizer: Any) -> None:
    """The agent's first turn is served; the engine then refuses its second (every attempt aborted, no token): the
    agent gets HTTP 503 engine_aborted and gives up. The episode failed (`error`, scored the failure reward -1), and
    its trajectory was trained: the sampled first turn under -1 for a refusal that was the engine's. Now it is
    `untrained` (end `abort`), no failure of the agent's (reward 0, not the failure reward): the batch row has no
    token in the loss. An agent that tries again after the 503 and
    is served trains as usual."""
    engine = RefusingEngine(tokenizer, refuse_from=1, refusals=MAX_IDLE_ABORTS)
    sessions, server = _serve(engine, tokenizer)
    seen: list[Any] = []
    gives_up = gives_up_on_refusal(seen)

    def tries_again(base_url: str, reward_url: str, row: Any) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="m", messages=HI)
        messages = [*HI, first.choices[0].message, *HI]
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="m", messages=messages)
        assert refused.value.status_code == 503
        client.chat.completions.create(model="m", messages=messages)
        return 1.0

    try:
        failed = _collector(sessions, server, gives_up).episode("ep0", {}, 0, 0, PARAMS)
        engine.requests.clear()
        recovered = _collector(sessions, server, tries_again).episode("ep1", {}, 0, 1, PARAMS)
    finally:
        server.close()
    (exc,) = seen
    assert (exc.status_code, exc.code) == (503, "engine_aborted")
    assert (failed.failure, failed.reward, failed.traj.turns, failed.aborted) == (None, 0.0, 1, True)
    assert failed.traj.end == "abort" and failed.traj.untrained and not failed.traj.success
    assert (recovered.failure, recovered.reward, recovered.traj.turns) == (None, 1.0, 2)
    assert recovered.traj.end == "terminated" and not recovered.traj.untrained
    tensors = to_tensors([failed.traj, recovered.traj], pad_id=0)
    per_turn = len(tokenizer("ok", add_special_tokens=False)["input_ids"]) + 1  # "ok" and EOS, as sampled
    assert tensors["response_mask"].sum(1).tolist() == [0, 2 * per_turn]
    assert tensors["turn_mask"].tolist() == [[0, 0], [1, 1]]


def test_a_chat_template_that_refuses_the_messages_is_a_400(tokenizer: Any) -> None:
    """A template's raise_exception (here: the first message must be a user's, as Llama 2 / Mistral templates
    demand alternation) was a 500 internal_error with a traceback, which the openai client retries: the agent's
    malformed conversation read as a server bug. Now it is a 400 naming the template's reason."""
    strict = build_tiny_tokenizer()
    strict.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversations start with a user') }}{% endif %}"
        + strict.chat_template
    )
    engine = RefusingEngine(strict, refuse_from=0, refusals=0)
    sessions, server = _serve(engine, strict)
    try:
        sessions.open("t", PARAMS, LIMITS)
        client = openai.OpenAI(base_url=server.base_url("t"), api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=[{"role": "assistant", "content": "x"}, *HI])
        assert exc.value.code == "invalid_message" and "conversations start with a user" in str(exc.value)
        r = client.chat.completions.create(model="m", messages=HI)  # the session still serves a valid request
        session = sessions.close("t")
    finally:
        server.close()
    assert r.choices[0].message.content == "ok" and len(engine.requests) == 1 and session.traj.turns == 1


@pytest.mark.parametrize(
    ("field", "code"),
    [
        ({"temperature": "hot"}, "invalid_parameter"),
        ({"temperature": 3}, "invalid_parameter"),
        ({"top_p": 1.5}, "invalid_parameter"),
        ({"seed": "x"}, "invalid_parameter"),
        ({"n": True}, "unsupported_parameter"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "invalid_tools"),
        # A schema that is no object reached the template as is: the model was offered a tool it cannot call right.
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "invalid_tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "invalid_tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]}, "invalid_tools"),
        ({"functions": [{"name": "add", "parameters": {"type": "object"}}]}, "unsupported_parameter"),
        # vLLM's extensions (an agent written for a vLLM server sends them in extra_body): the reply was unconstrained,
        # or did not stop where asked, with nothing to tell the agent.
        ({"guided_json": {"type": "object"}}, "unsupported_parameter"),
        ({"guided_choice": ["yes", "no"]}, "unsupported_parameter"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "unsupported_parameter"),
        ({"stop_token_ids": [5]}, "unsupported_parameter"),
        ({"min_tokens": 4}, "unsupported_parameter"),
        ({"ignore_eos": True}, "unsupported_parameter"),
        ({"repetition_penalty": 1.3}, "unsupported_parameter"),
        ({"best_of": 2}, "unsupported_parameter"),
    ],
)
def test_malformed_or_unsupported_fields_are_400s_and_reach_no_engine(
    tokenizer: Any, field: dict[str, Any], code: str
) -> None:
    """Each was answered 200 by a sample that ignored it: the legacy `functions` silently never reached the model
    (the agent got plain text where it expected a function call), a tool without a name was offered to the model,
    and out-of-range or mistyped sampling fields, which OpenAI refuses, passed. vLLM's extensions at their neutral
    values (and its top_k / min_p, which the run decides as it does temperature) are served."""
    engine = RefusingEngine(tokenizer, refuse_from=0, refusals=0)
    sessions, server = _serve(engine, tokenizer)
    try:
        sessions.open("f", PARAMS, LIMITS)
        status, body = _post(server.base_url("f") + "/chat/completions", json.dumps({"messages": HI, **field}).encode())
        valid = {"messages": HI, "temperature": 0.0, "top_p": 1, "seed": 3, "n": 1, "top_k": 20, "min_p": 0.05}
        valid |= {"repetition_penalty": 1.0, "best_of": 1, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": []}
        ok, _ = _post(server.base_url("f") + "/chat/completions", json.dumps(valid).encode())
    finally:
        server.close()
    assert status == 400, body  # was a 200 answer
    assert body["error"]["code"] == code
    assert ok == 200 and len(engine.requests) == 1  # the valid request alone was sampled


def test_a_deeply_nested_body_is_a_400(tokenizer: Any) -> None:
    """JSON nested past the parser's recursion limit was a 500 internal_error (a RecursionError), which clients
    retry."""
    sessions, server = _serve(RefusingEngine(tokenizer, 0, 0), tokenizer)
    try:
        sessions.open("d", PARAMS, LIMITS)
        deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        status, body = _post(server.base_url("d") + "/chat/completions", deep)
    finally:
        server.close()
    assert (status, body["error"]["code"]) == (400, "invalid_json")


def test_closing_the_server_aborts_the_requests_in_flight(tokenizer: Any) -> None:
    """close() with a turn in flight waited 10 s for the loop's thread, then left the request running on the
    engine and its worker thread blocked on it: from an engine that never answers, forever, and the interpreter
    joins the pool's threads at exit, so the process hung there. Now close() aborts it (the session answers 410
    after) and returns at once; the session stays open for its episode to close."""
    engine = HangingEngine(tokenizer)
    sessions, server = _serve(engine, tokenizer)
    sessions.open("h", PARAMS, LIMITS)
    answers: list[int] = []

    def call() -> None:
        try:
            status, _ = _post(server.base_url("h") + "/chat/completions", json.dumps({"messages": HI}).encode())
            answers.append(status)
        except (OSError, ValueError):  # the connection may go with the server
            answers.append(-1)

    client = threading.Thread(target=call, daemon=True)
    client.start()
    assert engine.submitted.wait(60)
    t0 = time.monotonic()
    server.close()
    took = time.monotonic() - t0
    client.join(60)
    workers = threads_left("roll-openai_", within_s=60)
    assert took < 5, took
    assert engine.aborted == [engine.requests[0].request_id] and not engine.pending and not workers
    assert answers and answers[0] in (410, -1)
    session = sessions.close("h")
    assert session.closed and session.traj.turns == 0 and len(engine.requests) == 1


class SessionRefusingEngine(RefusingEngine):
    """Answers "ok" (then EOS), except that every request of the sessions in `refused` after their first is aborted
    with no token (an engine that keeps refusing those episodes' second turn)."""

    def __init__(self, tokenizer: Any, refused: set[str]) -> None:
        super().__init__(tokenizer, 0, 0)
        self.refused, self.seen, self.lock = refused, Counter(), threading.Lock()

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        with self.lock:
            self.seen[route_key] += 1
            refuse = route_key in self.refused and self.seen[route_key] > 1
        if not refuse:
            with self.lock:
                return super().submit_request(request, route_key)
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "abort"))
        return fut


@pytest.mark.usefixtures("quick_backoff")
def test_a_collector_step_keeps_engine_refused_episodes_out_of_the_batch_and_the_agents_failures(
    tokenizer: Any,
) -> None:
    """Two task rows x three episodes; the engine refuses the second turn of ep1, ep4 and ep5 (503), whose agents
    give up: ep1 raises, ep4 reports no reward, ep5 scores itself 0.25. They were agent/failed_error and
    agent/failed_no_reward (the agent blamed for the engine's refusal), scored -1 into reward/mean, and all six rows
    went to the batch: three that train nothing, yet their -1 / 0.25 joined their groups' reward statistics (row 1's
    mean 0.17, not 1). Now they are counted as aborted and dropped like pipeline=agentic's untrained episodes."""
    refused = {"ep1", "ep4", "ep5"}
    engine = SessionRefusingEngine(tokenizer, refused)
    sessions, server = _serve(engine, tokenizer)
    rewards = {"ep0": 1.0, "ep2": 0.0, "ep3": 1.0}

    def program(base_url: str, reward_url: str, row: Any) -> float | None:
        sid = base_url.split("/sessions/")[1].split("/")[0]
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="m", messages=HI)
        try:
            client.chat.completions.create(model="m", messages=[*HI, first.choices[0].message, *HI])
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            if sid == "ep1":
                raise
            return None if sid == "ep4" else 0.25
        return rewards[sid]

    c = _collector(sessions, server, program)
    c.task.on_failure, c.task.train_rows = "score", lambda count, seed: [{"row": i} for i in range(count)]
    c.cfg = SimpleNamespace(algo=SimpleNamespace(group_size=3), pipeline=SimpleNamespace(rollout_batch_size=2, seed=0))
    c.ctx = SimpleNamespace(sampling=PARAMS, samples=lambda step, rows: None)
    c.tokenizer, c._episodes = tokenizer, 0
    out = StepLog()
    try:
        collected = c.next(1, out)
    finally:
        server.close()
    assert collected is not None
    batch = collected.batch
    assert batch["group_ids"].tolist() == [0, 0, 1] and collected.scores.tolist() == [1.0, 0.0, 1.0]
    assert int(batch["response_mask"].sum(1).min()) > 0  # every row trains something
    assert (out["data/dropped_episodes"], out["data/aborted_episodes"], out["agent/aborted_episodes"]) == (3, 3, 3.0)
    assert {k: out[f"agent/failed_{k}"] for k in ("error", "timeout", "no_reward")} == dict.fromkeys(
        ("error", "timeout", "no_reward"), 0.0
    )
    assert out["agent/failed_episodes"] == 0.0 and out["episode/end_abort"] == 0.5
    assert out["reward/mean"] == pytest.approx(2 / 3) and out["episode/success_rate"] == pytest.approx(2 / 3)
    assert out["episode/turns_mean"] == 2.0


class PausedEngine(RefusingEngine):
    """Aborts every request with no token until `pause_s` after the first one (an engine paused for a weight sync),
    then answers "ok"; `times`: when each request came."""

    def __init__(self, tokenizer: Any, pause_s: float) -> None:
        super().__init__(tokenizer, 0, 0)
        self.pause_s, self.times = pause_s, []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.times.append(time.monotonic())
        if self.times[-1] - self.times[0] >= self.pause_s:
            return super().submit_request(request, route_key)
        self.requests.append(request)
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "abort"))
        return fut


def test_a_turn_waits_out_an_engine_paused_for_a_moment(tokenizer: Any) -> None:
    """The endpoint asked again at once after each idle abort: an engine paused for 0.3 s used up all
    MAX_IDLE_ABORTS tries within milliseconds and the agent got HTTP 503. Now the tries back off (50, 100, 200 ms)
    and the turn is sampled."""
    engine = PausedEngine(tokenizer, pause_s=0.3)
    sessions, server = _serve(engine, tokenizer)
    try:
        sessions.open("w", PARAMS, LIMITS)
        client = openai.OpenAI(base_url=server.base_url("w"), api_key="unused", max_retries=0)
        t0 = time.monotonic()
        reply = client.chat.completions.create(model="m", messages=HI)
        took = time.monotonic() - t0
        session = sessions.close("w")
    finally:
        server.close()
    assert reply.choices[0].message.content == "ok" and took < 10.0, took
    # Idle aborts before the answer: at least one (the pause); 2 normally, but a loaded machine may delay the second
    # try past the pause. The fault (no backoff) is the 503 above.
    assert 1 <= len(engine.requests) - 1 < MAX_IDLE_ABORTS
    assert (session.traj.turns, session.traj.untrained, session.resumed) == (1, False, len(engine.requests) - 1)


def test_an_engine_that_never_answers_is_refused_in_bounded_time_and_a_close_ends_the_wait(tokenizer: Any) -> None:
    """The backoff stays bounded: an engine that aborts every try still answers the agent 503 after
    MAX_IDLE_ABORTS tries, within idle_backoff_total_s() (a few seconds), each wait at least the documented one.
    A session closed during a wait answers 410 at once instead of sleeping out the backoff."""
    assert 1.0 < idle_backoff_total_s() <= 5.0
    engine = PausedEngine(tokenizer, pause_s=float("inf"))
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), tokenizer.decode, HermesToolParser())
    sessions.open("n", PARAMS, LIMITS)
    t0 = time.monotonic()
    with pytest.raises(SessionError) as err:
        sessions.chat("n", ChatTurn(messages=HI))
    took = time.monotonic() - t0
    assert (err.value.status, err.value.code, len(engine.requests)) == (503, "engine_aborted", MAX_IDLE_ABORTS)
    assert idle_backoff_total_s() * 0.95 <= took <= idle_backoff_total_s() + 5.0, took
    gaps = [b - a for a, b in zip(engine.times, engine.times[1:])]
    assert all(g >= 0.95 * idle_backoff_s(k) for k, g in enumerate(gaps, 1)), gaps

    engine = PausedEngine(tokenizer, pause_s=float("inf"))
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), tokenizer.decode, HermesToolParser())
    sessions.open("c", PARAMS, LIMITS)
    errors: list[SessionError] = []
    ended: list[float] = []

    def call() -> None:
        try:
            sessions.chat("c", ChatTurn(messages=HI))
        except SessionError as exc:
            errors.append(exc)
        ended.append(time.monotonic())

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    deadline = time.monotonic() + 60
    while len(engine.requests) < 5 and time.monotonic() < deadline:  # in its 5th wait (800 ms)
        time.sleep(0.01)
    sessions.close("c")
    caller.join(60)
    assert not caller.is_alive()
    assert [(e.status, e.code) for e in errors] == [(410, "session_closed")]
    assert len(engine.requests) == 5
    # Ended before the 5th wait was out (a wait sleeps at least its backoff, measured above), not after it.
    assert ended[0] - engine.times[4] < idle_backoff_s(5), (ended[0] - engine.times[4], idle_backoff_s(5))
