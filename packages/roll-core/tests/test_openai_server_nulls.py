"""The OpenAI-compatible endpoint reads requests as OpenAI does where clients differ: a field sent as JSON null (the
openai client with an explicit None, frameworks that serialise every field) is a field left out; an assistant message
with neither content nor tool calls is a 400 naming it; and a client's retry that arrives just as its original takes
the session waits for the original's reply instead of a 409. Scripted request engines on 127.0.0.1, as
test_openai_server.py."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from roll_core.agentic.agent_sessions import AgentSessions, ChatTurn, ParsedReply, SessionError, SessionLimits
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import chat_turn
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.agent_endpoint import ScriptedTextEngine, post_json, serve


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
LIMITS = SessionLimits(max_context_length=1024)
HI = [{"role": "user", "content": "hi"}]


def _decoder(tokenizer: Any) -> Any:
    """The endpoint's reply decoder (roll_core.testing.agent_endpoint.serve): no special tokens."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


#: Every optional field of OpenAI's chat completions (and vLLM's extensions the endpoint refuses), sent as null.
NULLS = dict.fromkeys(
    "temperature top_p max_tokens max_completion_tokens stop tools tool_choice seed n stream stream_options "
    "response_format logprobs top_logprobs logit_bias presence_penalty frequency_penalty parallel_tool_calls user "
    "functions function_call metadata store service_tier reasoning_effort top_k min_p repetition_penalty best_of "
    "guided_json stop_token_ids min_tokens ignore_eos".split()
)


def test_null_fields_are_fields_left_out(tokenizer: Any) -> None:
    """Top-level nulls were already read as left out (served 200, the session's defaults). Nested ones were not: a
    tool call's `id: null` became the id "None", `arguments: null` the text "null", and a json_schema whose optional
    `schema` is null a 400; each is now what the left-out field is."""
    assert chat_turn({"messages": HI, **NULLS}) == chat_turn({"messages": HI})

    def history(**call: Any) -> list[dict[str, Any]]:
        fn = {"name": "add", **{k: v for k, v in call.items() if k != "id"}}
        calls = [{"type": "function", "function": fn, **({"id": call["id"]} if "id" in call else {})}]
        return [*HI, {"role": "assistant", "content": None, "tool_calls": calls}, *HI]

    assert chat_turn({"messages": history(id=None)}) == chat_turn({"messages": history()})
    assert chat_turn({"messages": history(id=None)}).messages[1]["tool_calls"][0]["id"] == ""
    assert chat_turn({"messages": history(arguments=None)}) == chat_turn({"messages": history()})
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": None}}
    left_out = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert chat_turn({"messages": HI, "response_format": schema}).structured.key() == (
        chat_turn({"messages": HI, "response_format": left_out}).structured.key()
    )

    engine = ScriptedTextEngine(tokenizer, ["a"])
    sessions, server = serve(engine, tokenizer)
    try:
        sessions.open("n", PARAMS, LIMITS)
        status, body = post_json(
            server.base_url("n") + "/chat/completions", json.dumps({"model": "m", "messages": HI, **NULLS}).encode()
        )
        session = sessions.close("n")
    finally:
        server.close()
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": "a"}
    assert session.traj.turns == 1 and session.requests == 1


@pytest.mark.parametrize(
    "assistant",
    [
        {"role": "assistant"},
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": None, "tool_calls": None},
        {"role": "assistant", "content": None, "tool_calls": []},
    ],
)
def test_an_assistant_message_with_neither_content_nor_tool_calls_is_a_400_naming_it(
    tokenizer: Any, assistant: dict[str, Any]
) -> None:
    """OpenAI answers 400 ("expected a string, got null"); it was a 200 whose prompt held an empty assistant turn
    the model never sampled. Content "" or tool calls with null content are still served."""
    engine = ScriptedTextEngine(tokenizer, ["a", "b"])
    sessions, server = serve(engine, tokenizer)
    url = server.base_url("e") + "/chat/completions"
    try:
        sessions.open("e", PARAMS, LIMITS)
        status, body = post_json(url, json.dumps({"messages": [*HI, assistant, *HI]}).encode())
        assert (status, body["error"]["code"]) == (400, "invalid_message"), body
        assert body["error"]["message"].startswith("messages[1]: an assistant message needs content or tool_calls")
        assert sessions.get("e").requests == 0 and engine.texts == ["a", "b"]  # refused before sampling
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        served = [
            {"role": "assistant", "content": ""},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
        tool = {"role": "tool", "tool_call_id": "c1", "content": "7"}
        for fine, after in zip(served, (HI, [tool])):
            status, body = post_json(url, json.dumps({"messages": [*HI, fine, *after]}).encode())
            assert status == 200, body
    finally:
        server.close()


def test_a_parsers_empty_reply_is_served_with_content_the_agent_can_send_back(tokenizer: Any) -> None:
    """A parser that makes neither content nor calls of a reply: its message went out with content null, which the
    agent's next request repeats, and that request is refused (above). It is served as content ""."""
    engine = ScriptedTextEngine(tokenizer, ["a", "b"])
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), _decoder(tokenizer), lambda text: ParsedReply(None))
    sessions.open("p", PARAMS, LIMITS)
    first = sessions.chat("p", ChatTurn(messages=list(HI)))
    assert first.message == {"role": "assistant", "content": ""} and first.finish_reason == "stop"
    again = chat_turn({"messages": [*HI, first.message, {"role": "user", "content": "more"}]})
    sessions.chat("p", again)
    session = sessions.close("p")
    assert session.traj.turns == 2 and session.rewrites == 0


class ClaimedLock:
    """A session's request lock that keeps the first request to take it there (between taking the lock and going
    on) until a later request reached the session (`arrived`: it tried this lock, or the session's claim lock, see
    `claim`): the window in which a client's retry used to arrive, held open however the threads are scheduled (a
    fixed 0.5 s window let a late retry on a loaded machine find the request named, and the test pass untested)."""

    def __init__(self) -> None:
        self.inner, self.taken, self.arrived = threading.Lock(), threading.Event(), threading.Event()
        self.waited: bool | None = None  # whether the first request saw a later one arrive while it held the lock

    def acquire(self, blocking: bool = True) -> bool:
        if self.taken.is_set():
            self.arrived.set()  # a later request tries the lock
        got = self.inner.acquire(blocking)
        if got and not self.taken.is_set():
            self.taken.set()
            self.waited = self.arrived.wait(60)
        return got

    def release(self) -> None:
        self.inner.release()

    def claim(self) -> _Claim:
        """The session's claim lock (taking the request lock and naming the request are one step under it): a later
        request that enters it while the first holds the request lock has arrived."""
        return _Claim(self)


class _Claim:
    def __init__(self, lock: ClaimedLock) -> None:
        self.lock, self.inner = lock, threading.Lock()

    def __enter__(self) -> None:
        if self.lock.taken.is_set():
            self.lock.arrived.set()  # blocks below until the first request named itself and let go
        self.inner.acquire()

    def __exit__(self, *exc: object) -> None:
        self.inner.release()


def test_a_retry_that_arrives_as_its_original_takes_the_session_gets_its_reply(tokenizer: Any) -> None:
    """The original took the session's lock but had not yet named itself the running request when its client's
    retry came: the retry was told 409 (another request runs), though it was that request. Now taking the lock and
    naming the request are one step: the retry waits and gets the original's reply, one sample for both."""
    engine = ScriptedTextEngine(tokenizer, ["one"])  # a second sample would find no text: an engine error
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), _decoder(tokenizer), lambda text: ParsedReply(text))
    sessions.open("r", PARAMS, LIMITS)
    session = sessions.get("r")
    lock = session.lock = ClaimedLock()
    session.claim = lock.claim()
    turn = chat_turn({"messages": HI})
    replies: dict[str, Any] = {}

    def ask(name: str, retry: bool) -> None:
        try:
            replies[name] = sessions.chat("r", turn, retry=retry).message["content"]
        except SessionError as exc:
            replies[name] = exc.status
        finally:
            if retry:
                lock.arrived.set()  # a retry that failed before reaching the session does not hold the original

    original = threading.Thread(target=ask, args=("original", False))
    original.start()
    assert lock.taken.wait(60)
    retry = threading.Thread(target=ask, args=("retry", True))
    retry.start()
    original.join(60)
    retry.join(60)
    assert lock.waited, "the retry never reached the session while the original held its lock"
    assert replies == {"original": "one", "retry": "one"}
    assert session.replays == 1 and session.requests == 1 and engine.texts == [] and session.traj.turns == 1
