"""The OpenAI-compatible endpoint's sessions over time, through the real `openai` client on scripted request
engines: a client's retry gets the recorded reply (and retries are capped), a repeated request that is no retry is a
new sample, history rewrites are counted and handled, a closed session answers 410 and runs no request, a context
refusal the agent recovers from does not end the trajectory, a client that leaves a streamed turn keeps it, and a
turn the engine aborts on its own is resumed. Replies, tool calls, request fields and errors:
test_openai_server.py."""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any

import openai
import pytest

from roll_core.agentic.agent_sessions import AgentSessions, SessionLimits
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import HermesToolParser
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.agent_endpoint import ScriptedTextEngine, openai_client, post_json, serve


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
RETRY = {"x-stainless-retry-count": "1"}  # what the openai clients send on a retry (0 on a first attempt)


class SlowScriptedEngine(ScriptedTextEngine):
    """ScriptedTextEngine whose answers take `delay` seconds (from a thread), counting its requests."""

    def __init__(self, tokenizer: Any, texts: list[str], delay: float) -> None:
        super().__init__(tokenizer, texts)
        self.delay, self.requests = delay, 0

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        import threading
        import time

        self.requests += 1
        done = super().submit_request(request, route_key)
        fut: Future = Future()
        threading.Thread(target=lambda: (time.sleep(self.delay), fut.set_result(done.result())), daemon=True).start()
        return fut


def test_a_session_closed_while_its_turn_is_prepared_runs_no_request(tokenizer: Any) -> None:
    """close() between the turn's checks and its submit (the template renders meanwhile) saw no request to abort:
    the request ran its whole budget after the episode ended. Now the turn notices and submits nothing."""
    import threading

    engine = SlowScriptedEngine(tokenizer, ["late"], delay=0.05)
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), lambda ids: tokenizer.decode(ids), HermesToolParser())
    sessions.open("c", PARAMS, SessionLimits(max_context_length=1024))
    session = sessions.get("c")
    rendering, release = threading.Event(), threading.Event()
    real = session.context_for

    def slow_context(turn: Any) -> Any:
        rendering.set()
        release.wait(60)
        return real(turn)

    session.context_for = slow_context
    from roll_core.agentic.agent_sessions import ChatTurn, SessionError

    errors: list[Exception] = []

    def chat() -> None:
        try:
            sessions.chat("c", ChatTurn(messages=[{"role": "user", "content": "hi"}]))
        except Exception as exc:
            errors.append(exc)

    worker = threading.Thread(target=chat)
    worker.start()
    assert rendering.wait(60)
    sessions.close("c")
    release.set()
    worker.join(60)
    assert not worker.is_alive()
    assert engine.requests == 0 and isinstance(errors[0], SessionError) and errors[0].status == 410


@pytest.mark.parametrize("policy", ["restart", "refuse"])
def test_a_client_retry_gets_the_recorded_reply_and_keeps_the_trajectory(tokenizer: Any, policy: str) -> None:
    """The openai client times out on a slow turn and re-sends it: the retry waits for the running turn and gets
    its reply, so the agent sees exactly the turn that is trained on; a retry after the reply arrived gets it again.
    (The retry was a history rewrite: `restart` dropped the turns the agent had seen, `refuse` answered 400.)"""
    engine = SlowScriptedEngine(tokenizer, ["one", "two", "three"], delay=0.05)
    sessions, server = serve(engine, tokenizer, on_rewrite=policy)
    try:
        sessions.open("r", PARAMS, SessionLimits(max_context_length=1024))
        patient = openai_client(server, "r")
        messages: list[Any] = [{"role": "user", "content": "a"}]
        r1 = patient.chat.completions.create(model="m", messages=messages)
        messages += [r1.choices[0].message, {"role": "user", "content": "b"}]
        engine.delay = 1.0  # the next turn outlasts the client's timeout: it retries while the turn runs
        hasty = openai.OpenAI(base_url=server.base_url("r"), api_key="unused", max_retries=3, timeout=0.4)
        r2 = hasty.chat.completions.create(model="m", messages=messages)
        # A client's retry (attempt 1, as the openai client marks it) that arrives after the reply was recorded.
        again = patient.chat.completions.create(model="m", messages=messages, extra_headers=RETRY)
        engine.delay = 0.05
        messages += [r2.choices[0].message, {"role": "user", "content": "c"}]
        r3 = patient.chat.completions.create(model="m", messages=messages)
        session = sessions.close("r")
    finally:
        server.close()
    assert r2.choices[0].message.content == again.choices[0].message.content == "two"
    assert r3.choices[0].message.content == "three" and engine.requests == 3  # one sample per turn, no more
    assert session.replays >= 2 and session.rewrites == 0 and session.dropped_turns == 0
    trained = tokenizer.decode([t for t, m in zip(session.traj.tokens, session.traj.mask) if m])
    assert trained == "one</s>two</s>three</s>" and session.traj.turns == 3


@pytest.mark.parametrize("policy", ["restart", "refuse"])
def test_history_rewrites_are_counted_and_handled(tokenizer: Any, policy: str) -> None:
    sessions, server = serve(ScriptedTextEngine(tokenizer, ["one", "two", "three"]), tokenizer, on_rewrite=policy)
    try:
        sessions.open("h", PARAMS, SessionLimits(max_context_length=1024))
        client = openai_client(server, "h")
        r1 = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        edited = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "ONE"}]  # not what was sampled
        messages = [*edited, {"role": "user", "content": "b"}]
        if policy == "refuse":
            with pytest.raises(openai.BadRequestError) as exc:
                client.chat.completions.create(model="m", messages=messages)
            assert exc.value.code == "history_rewritten"
            messages = [{"role": "user", "content": "a"}, r1.choices[0].message, {"role": "user", "content": "b"}]
        client.chat.completions.create(model="m", messages=messages)
        session = sessions.close("h")
    finally:
        server.close()
    assert session.rewrites == 1
    traj = session.traj
    if policy == "restart":  # the rewritten history is the new prompt; the turn sampled before it is not trained
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert traj.prompt_ids == list(prompt) and traj.turns == 1 and session.dropped_turns == 1
        assert tokenizer.decode([t for t, m in zip(traj.tokens, traj.mask) if m]) == "two</s>"
    else:  # refused: the session went on from the unchanged conversation
        assert traj.turns == 2 and session.dropped_turns == 0
        assert tokenizer.decode([t for t, m in zip(traj.tokens, traj.mask) if m]) == "one</s>two</s>"


def test_a_repeated_request_that_is_no_retry_gets_a_new_sample_and_counts_as_a_turn(tokenizer: Any) -> None:
    """An agent that asks the same messages again (another sample, "retry until it parses") with a client that does
    not retry: each request is sampled (the repeat restarts the trajectory), and max_turns stops the loop. It got
    the first reply back forever, replays never counted, and the episode looped until its timeout."""
    engine = SlowScriptedEngine(tokenizer, ["not json", '{"ok": 1}', "c", "d"], delay=0.0)
    sessions, server = serve(engine, tokenizer)
    try:
        sessions.open("p", PARAMS, SessionLimits(max_turns=3, max_context_length=1024))
        client = openai_client(server, "p")
        hi = [{"role": "user", "content": "Answer in JSON"}]
        answers = [client.chat.completions.create(model="m", messages=hi).choices[0].message.content for _ in "abc"]
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=hi)
        assert exc.value.code == "max_turns_exceeded"
        session = sessions.close("p")
    finally:
        server.close()
    assert answers == ["not json", '{"ok": 1}', "c"] and engine.requests == 3 and session.replays == 0
    assert session.requests == 3 and session.traj.turns == 1 and session.dropped_turns == 2  # trained: the last


def test_retries_of_one_request_are_capped(tokenizer: Any) -> None:
    """A client that retries a request forever gets the recorded reply at most MAX_REPLAYS_PER_TURN times, then
    HTTP 400."""
    from roll_core.agentic.agent_sessions import MAX_REPLAYS_PER_TURN

    engine = SlowScriptedEngine(tokenizer, ["one", "two"], delay=0.0)
    sessions, server = serve(engine, tokenizer)
    try:
        sessions.open("c", PARAMS, SessionLimits(max_turns=2, max_context_length=1024))
        hi = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}]}).encode()
        url = server.base_url("c") + "/chat/completions"
        first = post_json(url, hi)[1]["choices"][0]["message"]["content"]
        again = [post_json(url, hi, RETRY) for _ in range(MAX_REPLAYS_PER_TURN)]
        status, refused = post_json(url, hi, RETRY)
        session = sessions.close("c")
    finally:
        server.close()
    assert status == 400 and refused["error"]["code"] == "too_many_retries"
    assert first == "one" and {r[1]["choices"][0]["message"]["content"] for r in again} == {"one"}
    assert engine.requests == 1 and session.replays == MAX_REPLAYS_PER_TURN


def test_the_retry_cap_is_per_turn_so_a_slow_engines_retries_do_not_refuse_later_turns(tokenizer: Any) -> None:
    """A slow engine and a client with a short timeout: every turn is answered to retries that waited for it (here
    two per turn, as the openai client's default max_retries sends). The cap counted replays over the episode
    (max_turns of them): the third turn's retry got 400 too_many_retries, for a turn that was sampled and recorded
    (trained) while the agent never saw it. Each turn's retries are now capped on their own."""
    engine = SlowScriptedEngine(tokenizer, ["one", "two", "three"], delay=0.0)
    sessions, server = serve(engine, tokenizer)
    try:
        sessions.open("s", PARAMS, SessionLimits(max_turns=3, max_context_length=1024))
        url = server.base_url("s") + "/chat/completions"
        messages: list[Any] = [{"role": "user", "content": "a"}]
        seen = []
        for turn in range(3):
            body = json.dumps({"model": "m", "messages": messages}).encode()
            post_json(url, body)  # the original: its client timed out, the reply went nowhere
            answers = [post_json(url, body, {"x-stainless-retry-count": str(k)}) for k in (1, 2)]
            assert [status for status, _ in answers] == [200, 200], answers
            reply = answers[-1][1]["choices"][0]["message"]
            seen.append(reply["content"])
            messages += [reply, {"role": "user", "content": f"u{turn}"}]
        session = sessions.close("s")
    finally:
        server.close()
    assert seen == ["one", "two", "three"] and engine.requests == 3 and session.replays == 6
    assert session.traj.turns == 3 and session.rewrites == 0


def test_a_closed_session_answers_410_to_requests_and_reward_reports(tokenizer: Any) -> None:
    """close() (the episode timed out) forgot the session: its agent's next request got 404 session_not_found,
    not the documented 410 session_closed; an id never opened is still 404."""
    sessions, server = serve(ScriptedTextEngine(tokenizer, ["a"]), tokenizer)
    try:
        sessions.open("x", PARAMS, SessionLimits(max_context_length=1024))
        hi = [{"role": "user", "content": "hi"}]
        r = openai_client(server, "x").chat.completions.create(model="m", messages=hi)
        sessions.close("x")
        with pytest.raises(openai.APIStatusError) as gone:
            openai_client(server, "x").chat.completions.create(
                model="m", messages=[*hi, r.choices[0].message, {"role": "user", "content": "more"}]
            )
        assert gone.value.status_code == 410 and gone.value.code == "session_closed"
        status, body = post_json(server.reward_url("x"), b'{"reward": 1.0}')
        assert status == 410 and body["error"]["code"] == "session_closed"
        status, body = post_json(server.reward_url("never"), b'{"reward": 1.0}')
        assert status == 404 and body["error"]["code"] == "session_not_found"
    finally:
        server.close()


def test_a_context_refusal_the_agent_recovers_from_does_not_end_the_trajectory(tokenizer: Any) -> None:
    """A request over the context limit is refused (400) and marks the trajectory ended there; the agent truncates
    the observation and goes on, its later turns are served, and the mark goes: the episode did not end at the
    limit, so a later crash is the program's failure (the mark stayed, and the crash was trained with reward 0)."""
    from roll_core.pipelines.collectors.agents import _outcome

    sessions, server = serve(ScriptedTextEngine(tokenizer, ["one", "two", "three"]), tokenizer)
    try:
        sessions.open("o", PARAMS, SessionLimits(max_turns=8, max_tokens_per_turn=16, max_context_length=200))
        client = openai_client(server, "o")
        messages: list[Any] = [{"role": "user", "content": "run ls"}]
        messages.append(client.chat.completions.create(model="m", messages=messages).choices[0].message)
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=[*messages, {"role": "user", "content": "file " * 400}])
        assert exc.value.code == "context_length_exceeded" and sessions.get("o").traj.end == "max_context"
        assert _outcome({"error": RuntimeError("400")}, sessions.get("o"), timed_out=False) == (0.0, None, "")
        messages.append({"role": "user", "content": "file (truncated)"})
        r = client.chat.completions.create(model="m", messages=messages)
        session = sessions.close("o")
    finally:
        server.close()
    assert r.choices[0].message.content == "two" and session.traj.turns == 2 and session.traj.end == ""
    assert _outcome({"error": KeyError("bug")}, session, timed_out=False)[1] == "error"
    assert session.finish(0.0, "env_error").end == "env_error"


def test_a_client_leaving_a_streamed_turn_logs_no_error_and_keeps_the_turn(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The client times out while the turn runs and closes the connection: writing the stream failed with an
    unhandled ClientConnectionResetError (a server error with a traceback in the log). The turn stays recorded and
    the client's retry gets it."""
    import logging
    import time

    engine = SlowScriptedEngine(tokenizer, ["slow one"], delay=0.6)
    sessions, server = serve(engine, tokenizer)
    try:
        sessions.open("d", PARAMS, SessionLimits(max_context_length=1024))
        hasty = openai.OpenAI(base_url=server.base_url("d"), api_key="unused", max_retries=0, timeout=0.1)
        hi = [{"role": "user", "content": "hi"}]
        with caplog.at_level(logging.DEBUG), pytest.raises(openai.APITimeoutError):
            list(hasty.chat.completions.create(model="m", messages=hi, stream=True))
        session = sessions.get("d")
        deadline = time.monotonic() + 60
        while session.traj.turns == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        retried = openai_client(server, "d").chat.completions.create(
            model="m", messages=hi, stream=True, extra_headers=RETRY
        )
        text = "".join(c.choices[0].delta.content or "" for c in retried if c.choices)
        sessions.close("d")
    finally:
        server.close()  # waits for the first handler, which writes the stream to the closed connection
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert session.traj.turns == 1 and text == "slow one" and engine.requests == 1 and session.replays == 1


class PreemptingEngine(ScriptedTextEngine):
    """ScriptedTextEngine that aborts its first `aborts` requests on its own after `partial` of the text's tokens."""

    def __init__(self, tokenizer: Any, texts: list[str], aborts: int, partial: int) -> None:
        super().__init__(tokenizer, texts)
        self.aborts, self.partial, self.requests = aborts, partial, []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.requests.append(request)
        if len(self.requests) > self.aborts:
            return super().submit_request(request, route_key)
        ids = self.tokenizer(self.texts[0], add_special_tokens=False)["input_ids"][: self.partial]
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.5] * len(ids), "abort"))
        return fut


def test_a_turn_the_engine_aborts_on_its_own_is_resumed_and_a_refusal_is_a_503(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own abort (preemption) ended the session's trajectory (`abort`) and answered 410 session_closed
    to an agent whose session was open, which then failed as if it had erred. The turn is resumed from its partial
    output within its budget; an engine that aborts every time without a token gets HTTP 503 engine_aborted, the
    conversation unchanged and the session still open."""
    from roll_core.agentic.agent_sessions import ChatTurn, SessionError

    hi = ChatTurn(messages=[{"role": "user", "content": "hi"}])
    text_ids = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    engine = PreemptingEngine(tokenizer, ["hello there"], aborts=1, partial=1)
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), lambda ids: tokenizer.decode(ids), HermesToolParser())
    sessions.open("p", PARAMS, SessionLimits(max_tokens_per_turn=16, max_context_length=1024))
    reply = sessions.chat("p", hi)
    session = sessions.get("p")
    first, resumed = engine.requests
    assert resumed.prompt_ids == first.prompt_ids + text_ids[:1]
    assert resumed.params.max_new_tokens == first.params.max_new_tokens - 1
    assert reply.token_ids == text_ids[:1] + text_ids + [tokenizer.eos_token_id]  # the partial output is kept
    assert (session.resumed, session.traj.turns, session.traj.end, session.closed) == (1, 1, "", False)

    from roll_core import idle_aborts
    from roll_core.agentic.agent_sessions import MAX_IDLE_ABORTS

    # the waits between a refused turn's tries (test_openai_server_refusals.py) are not this test's subject
    monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_MAX_S", 0.001)
    refusing = PreemptingEngine(tokenizer, ["x"], aborts=10**6, partial=0)
    sessions = AgentSessions(refusing, TurnTemplate(tokenizer), lambda ids: tokenizer.decode(ids), HermesToolParser())
    sessions.open("r", PARAMS, SessionLimits(max_tokens_per_turn=16, max_context_length=1024))
    with pytest.raises(SessionError) as err:
        sessions.chat("r", hi)
    assert (err.value.status, err.value.code, len(refusing.requests)) == (503, "engine_aborted", MAX_IDLE_ABORTS)
    session = sessions.get("r")
    # The conversation is unchanged and the session open; the trajectory ends there, untrained, unless a turn follows
    # (test_openai_server_refusals.py).
    assert (session.traj.turns, session.traj.end, session.traj.untrained, session.closed) == (0, "abort", True, False)
