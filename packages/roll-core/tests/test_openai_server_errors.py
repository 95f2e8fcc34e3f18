"""The OpenAI-compatible endpoint when the inference engine raises during a turn, over HTTP on 127.0.0.1: the agent
gets OpenAI's error JSON naming the engine failure (500 `engine_error`; 503 `engine_restarting` with Retry-After
for a rank being restarted), no half turn is recorded, and the episode is left untrained (counted as aborted by the
agent collector) instead of scoring the engine's failure as the agent's."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.agentic.agent_sessions import MAX_IDLE_ABORTS, SessionLimits
from roll_core.cluster.group import WorkerRestartedError
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.agent_endpoint import gives_up_on_refusal, quick_idle_backoff, serve

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
LIMITS = SessionLimits(max_turns=4, max_tokens_per_turn=16, max_context_length=1024)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    quick_idle_backoff(monkeypatch)


class ScriptedEngine:
    """Request k follows script[k] (the last entry repeats): "ok" answers "ok" + EOS; "partial" is aborted after
    two tokens (a preemption, resumed by the session); "abort" is aborted with no token; an exception instance fails
    the request's future with it; ("submit", exc) raises it from submit_request itself."""

    def __init__(self, tokenizer: Any, script: list[Any]) -> None:
        self.tokenizer, self.script, self.requests = tokenizer, script, []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        step = self.script[min(len(self.requests), len(self.script) - 1)]
        self.requests.append(request)
        if isinstance(step, tuple):
            raise step[1]
        fut: Future = Future()
        ok = self.tokenizer("ok", add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        if isinstance(step, BaseException):
            fut.set_exception(step)
        elif step == "ok":
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ok, [-0.25] * len(ok), "stop"))
        else:
            ids = ok[:2] if step == "partial" else []
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.5] * len(ids), "abort"))
        return fut

    def abort(self, request_id: str) -> bool:
        return False

    def check_sampling(self, params: SamplingParams) -> None:
        return None


def _post(url: str, messages: list[Any]) -> tuple[int, Any, Any]:
    """(status, JSON body, headers) of a chat request."""
    body = json.dumps({"model": "m", "messages": messages}).encode()
    req = urllib.request.Request(url + "/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def _second_turn(tokenizer: Any) -> list[Any]:
    return [*HI, {"role": "assistant", "content": "ok"}, *HI]


@pytest.mark.usefixtures("quick_backoff")
@pytest.mark.parametrize("how", ["future", "submit", "after_partial"])
def test_an_engine_failure_is_a_500_naming_it_and_no_half_turn_is_recorded(
    tokenizer: Any, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine raised during the second turn (its future failed, its submit raised, or the resume of a
    preempted turn that had sampled two tokens failed): the agent got 500 `internal_error` as if the endpoint had a
    bug, and the session kept the episode trainable, so an agent that gave up was scored the failure reward on its
    first turn for the engine's fault. Now: 500 `engine_error` naming the engine's failure (no traceback in the
    body; it is logged), nothing of the failed turn recorded, the episode untrained until a later turn is
    sampled."""
    died = RuntimeError("hf engine shut down")
    failing = {"future": [died], "submit": [("submit", died)], "after_partial": ["partial", died]}[how]
    engine = ScriptedEngine(tokenizer, ["ok", *failing, "ok"])
    sessions, server = serve(engine, tokenizer)
    try:
        sessions.open("e", PARAMS, LIMITS)
        assert _post(server.base_url("e"), HI)[0] == 200
        with caplog.at_level(logging.WARNING):
            status, body, headers = _post(server.base_url("e"), _second_turn(tokenizer))
        session = sessions.get("e")
        mid = (session.traj.turns, sum(session.traj.mask), session.traj.untrained, session.traj.end)
        again = _post(server.base_url("e"), _second_turn(tokenizer))  # the agent tries again and is served
        sessions.close("e")
    finally:
        server.close()
    assert status == 500, body
    err = body["error"]
    assert (err["type"], err["code"], err["param"]) == ("server_error", "engine_error", None)
    assert "the inference engine failed" in err["message"] and "RuntimeError: hf engine shut down" in err["message"]
    assert "Traceback" not in err["message"] and "Retry-After" not in headers
    assert any(r.exc_info and r.exc_info[1] is died for r in caplog.records)  # the traceback is in the log
    per_turn = len(tokenizer("ok", add_special_tokens=False)["input_ids"]) + 1
    assert mid == (1, per_turn, True, "abort")  # the first turn only; the partial one's two tokens are not in it
    assert again[0] == 200 and session.engine_errors == 1
    assert (session.traj.turns, sum(session.traj.mask), session.traj.untrained) == (2, 2 * per_turn, False)


def test_a_restarting_engine_is_a_503_with_retry_after(tokenizer: Any) -> None:
    """A rank that died during the request and is being restarted (`WorkerRestartedError`) is a transient state:
    503 `engine_restarting` with a Retry-After the openai clients honour (it was a 500 `internal_error`)."""
    engine = ScriptedEngine(tokenizer, [WorkerRestartedError("actor_infer: rank(s) [0] restarted", [0]), "ok"])
    sessions, server = serve(engine, tokenizer)
    try:
        sessions.open("r", PARAMS, LIMITS)
        status, body, headers = _post(server.base_url("r"), HI)
        session = sessions.close("r")
    finally:
        server.close()
    assert status == 503, body
    err = body["error"]
    assert (err["type"], err["code"]) == ("server_error", "engine_restarting")
    assert "restarted" in err["message"] and int(headers["Retry-After"]) >= 1
    assert (session.traj.turns, session.traj.untrained, session.engine_errors) == (0, True, 1)


@pytest.mark.usefixtures("quick_backoff")
def test_an_engine_refusal_503_says_when_to_retry(tokenizer: Any) -> None:
    """The existing 503 `engine_aborted` (every try aborted, as by an engine paused for a weight sync) carried no
    Retry-After: clients retried on their own short schedule into the same pause."""
    engine = ScriptedEngine(tokenizer, ["abort"])
    sessions, server = serve(engine, tokenizer)
    try:
        sessions.open("a", PARAMS, LIMITS)
        status, body, headers = _post(server.base_url("a"), HI)
        sessions.close("a")
    finally:
        server.close()
    assert (status, body["error"]["code"], len(engine.requests)) == (503, "engine_aborted", MAX_IDLE_ABORTS)
    assert int(headers["Retry-After"]) >= 1


def test_an_agent_that_gives_up_on_an_engine_failure_is_counted_aborted_not_failed(tokenizer: Any) -> None:
    """Through the agent collector: the agent's first turn is served, the engine fails its second, the agent raises.
    The episode was agent/failed_error, scored the failure reward (-1) on its sampled first turn; now it is an
    aborted episode (untrained, end `abort`, reward 0, no failure), like an engine refusal."""
    from roll_core.pipelines.collectors.agents import AgentCollector, agent_metrics

    engine = ScriptedEngine(tokenizer, ["ok", RuntimeError("CUDA error: an illegal memory access")])
    sessions, server = serve(engine, tokenizer)
    seen: list[Any] = []
    gives_up = gives_up_on_refusal(seen)

    c = AgentCollector.__new__(AgentCollector)  # the episode part only, on the real server
    c.sessions, c.server, c.limits = sessions, server, LIMITS
    c.task = SimpleNamespace(run_episode=gives_up, episode_timeout_s=20.0, failure_reward=-1.0, success_reward=1.0)
    try:
        episode = c.episode("ep0", {}, 0, 0, PARAMS)
    finally:
        server.close()
    (exc,) = seen
    assert (exc.status_code, exc.code, exc.type) == (500, "engine_error", "server_error")
    assert "CUDA error: an illegal memory access" in exc.message
    assert (episode.failure, episode.reward, episode.aborted, episode.traj.turns) == (None, 0.0, True, 1)
    assert episode.traj.end == "abort" and not episode.traj.success
    m = agent_metrics([episode])
    assert (m["agent/aborted_episodes"], m["agent/failed_episodes"], m["agent/failed_error"]) == (1.0, 0.0, 0.0)
    assert m["agent/engine_errors"] == 1.0
