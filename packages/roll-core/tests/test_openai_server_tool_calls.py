"""Tool calls at the OpenAI-compatible endpoint, adversarially: what the Hermes parser makes of replies that hold the
closing marker in an argument, calls inside `<think>` reasoning, nesting too deep for the JSON reader, non-ASCII
arguments, a reply cut off after its calls; tool messages that answer no call; and the trajectory of a tool-call
turn the agent echoes back re-serialised (exactly the sampled ids, no history rewrite). Scripted request engines on
127.0.0.1, as test_openai_server.py."""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any

import pytest

from roll_core.agentic.agent_sessions import AgentSessions, ChatTurn, SessionError, SessionLimits
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import HermesToolParser, chat_turn
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.agent_endpoint import ScriptedTextEngine, openai_client, post_json, serve

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64, seed=5)
LIMITS = SessionLimits(max_tokens_per_turn=64, max_context_length=2048)
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def _call(name: str, **args: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


class RecordingEngine(ScriptedTextEngine):
    """A scripted engine that keeps each request's prompt and sampled ids, and finishes with `finish` (a "length"
    reply has no EOS, as a reply cut off by its token budget)."""

    def __init__(self, tokenizer: Any, texts: list[str], finish: str = "stop") -> None:
        super().__init__(tokenizer, texts)
        self.finish, self.outputs = finish, []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"]
        if self.finish == "stop":
            ids.append(self.tokenizer.eos_token_id)
        out = RequestOutput(request.request_id, list(request.prompt_ids), ids, [-0.5] * len(ids), self.finish)
        self.outputs.append(out)
        fut: Future = Future()
        fut.set_result(out)
        return fut


# ---- the parser -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        {"code": "print('</tool_call>')"},  # the closing marker in a string: the block ended there, invalid
        {"s": "<tool_call>inner</tool_call> and {braces}", "d": {"a": [1, {"b": "}"}]}},
    ],
)
def test_hermes_reads_a_calls_json_to_its_end_not_to_the_first_closing_marker(args: dict[str, Any]) -> None:
    text = f"Writing. {_call('run', **args)}\n{_call('check')}"
    parsed = HermesToolParser()(text)
    assert [c["name"] for c in parsed.calls] == ["run", "check"] and parsed.invalid == 0
    assert json.loads(parsed.calls[0]["arguments"]) == args and parsed.content == "Writing."


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (f"<think>maybe {_call('rm', path='/')}</think>\n\nNo.", []),
        (f"<think>maybe {_call('rm', path='/')}</think>\n\n{_call('ls')}", ["ls"]),
        # a template whose generation header opens the reasoning (QwQ, Qwen3 thinking): only its end is sampled
        (f"maybe {_call('rm', path='/')}</think>\n\n{_call('ls')}", ["ls"]),
    ],
)
def test_hermes_calls_inside_thinking_are_no_calls(text: str, names: list[str]) -> None:
    """The model reasoning about a call was served the call (vLLM's reasoning parser takes it out first)."""
    parsed = HermesToolParser()(text)
    assert [c["name"] for c in parsed.calls] == names and parsed.invalid == 0
    assert parsed.content.startswith(text[: text.index("</think>")])  # the reasoning stays content, as written


def test_hermes_a_reply_cut_off_while_thinking_has_no_invalid_call() -> None:
    parsed = HermesToolParser()('<think>I will call <tool_call>{"name": "ls", "argu')
    assert parsed.calls == [] and parsed.invalid == 0


def test_hermes_nesting_too_deep_for_json_is_an_invalid_block() -> None:
    """A degenerate reply (`[[[[...`) raised RecursionError out of the parser: a 500 and a sampled turn unrecorded."""
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"
    in_args = '<tool_call>{"name": "run", "arguments": "' + "[" * 5000 + '"}</tool_call>'
    parsed = HermesToolParser()(f"{deep}{in_args}{_call('ls')}")
    assert [c["name"] for c in parsed.calls] == ["ls"] and parsed.invalid == 2


def test_hermes_arguments_keep_their_characters() -> None:
    """Arguments written as an object were served with `\\u` escapes; vLLM serves the characters as written."""
    (call,) = HermesToolParser()(_call("run", q="café ☃ 日本")).calls
    assert call["arguments"] == '{"q": "café ☃ 日本"}'


# ---- sessions -----------------------------------------------------------------------------------------------------
def test_a_reply_cut_off_after_its_calls_finishes_with_length(tokenizer: Any) -> None:
    """Complete calls, then a block cut off by the token budget: finish_reason was "tool_calls", a whole reply to
    the agent; it is "length" (OpenAI's precedence), the complete calls served, the cut block left in the content."""
    text = _call("ls") + '\n<tool_call>{"name": "run", "arg'
    engine = RecordingEngine(tokenizer, [text], finish="length")
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), tokenizer.decode, HermesToolParser())
    sessions.open("c", PARAMS, LIMITS)
    reply = sessions.chat("c", ChatTurn(messages=list(HI), tools=TOOLS))
    session = sessions.close("c")
    assert reply.finish_reason == "length"
    assert [c["function"]["name"] for c in reply.message["tool_calls"]] == ["ls"]
    assert reply.message["content"] == '<tool_call>{"name": "run", "arg' and session.invalid_tool_calls == 1
    assert session.traj.cut_turns == 1 and session.traj.tokens == engine.outputs[0].token_ids


def test_a_request_that_stops_on_the_closing_marker_gets_its_call(tokenizer: Any) -> None:
    """`stop=["</tool_call>"]` (an agent that takes one call per turn): the served text ends before the stop string,
    so every call was an unclosed, invalid block and reached the agent as content."""
    engine = RecordingEngine(tokenizer, [f"Listing. {_call('ls', d='/')}"])
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), tokenizer.decode, HermesToolParser())
    sessions.open("s", PARAMS, LIMITS)
    reply = sessions.chat("s", ChatTurn(messages=list(HI), tools=TOOLS, stop=("</tool_call>",)))
    session = sessions.close("s")
    assert reply.finish_reason == "tool_calls" and reply.message["content"] == "Listing."
    (call,) = reply.message["tool_calls"]
    assert call["function"] == {"name": "ls", "arguments": '{"d": "/"}'} and session.invalid_tool_calls == 0
    assert session.traj.tokens == engine.outputs[0].token_ids  # the stop string's tokens stay in the trajectory


@pytest.mark.parametrize(
    ("tail", "at"),
    [
        ([{"role": "tool", "tool_call_id": "call_9", "content": "x"}], 2),  # not the id of the call
        ([{"role": "user", "content": "and"}, {"role": "tool", "tool_call_id": "call_0_0", "content": "x"}], 3),
    ],
)
def test_a_tool_message_that_answers_no_call_is_a_400(tail: list[dict[str, Any]], at: int) -> None:
    """OpenAI answers 400; the endpoint served it, and the template (which renders results by position, without
    ids) gave the model the result as the answer to a call it did not make."""
    call = {"id": "call_0_0", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(SessionError) as exc:
        chat_turn({"messages": [*history, *tail]})
    assert (exc.value.status, exc.value.code) == (400, "invalid_message")
    assert exc.value.message.startswith(f"messages[{at}].tool_call_id=")
    with pytest.raises(SessionError, match="no tool calls"):
        chat_turn({"messages": [{"role": "tool", "tool_call_id": "x", "content": "x"}]})
    two = {**call, "id": "call_0_1"}
    history[1] = {**history[1], "tool_calls": [call, two]}
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "x"} for c in (two, call)]  # any order
    assert len(chat_turn({"messages": [*history, *results]}).messages) == 4


def test_an_echoed_tool_call_turn_keeps_exactly_the_sampled_ids(tokenizer: Any) -> None:
    """The agent echoes the tool-call reply with its arguments re-serialised (other spacing and key order, or as an
    object): the session matches it (no history rewrite), the trajectory holds the sampled ids (never the parsed
    calls re-rendered) and the next engine request's prompt is exactly the trajectory so far."""
    args = {"code": "print('</tool_call>')", "q": "café"}
    first = f"Sure. {_call('run', **args)}{_call('ls', b=1, a=2)}"
    engine = RecordingEngine(tokenizer, [first, "done"])
    sessions, server = serve(engine, tokenizer)
    try:
        sessions.open("e", PARAMS, LIMITS)
        client = openai_client(server, "e")
        r1 = client.chat.completions.create(model="m", messages=HI, tools=TOOLS)
        assert r1.choices[0].finish_reason == "tool_calls"
        echo = r1.choices[0].message.model_dump(exclude_none=True)
        run, ls = echo["tool_calls"]
        run["function"]["arguments"] = json.dumps(json.loads(run["function"]["arguments"]), separators=(",", ":"))
        ls["function"]["arguments"] = {"a": 2, "b": 1}  # an object, keys in another order
        results = [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in (run, ls)]
        r2 = client.chat.completions.create(model="m", messages=[*HI, echo, *results], tools=TOOLS)
        assert r2.choices[0].message.content == "done"
        session = sessions.close("e")
    finally:
        server.close()
    traj, (o1, o2) = session.traj, engine.outputs[:2]
    assert session.rewrites == 0 and traj.turns == 2 and traj.prompt_ids == o1.prompt_ids
    n1, n2 = len(o1.token_ids), len(o2.token_ids)
    assert traj.tokens[:n1] == o1.token_ids and traj.mask[:n1] == [1] * n1
    assert o2.prompt_ids == traj.prompt_ids + traj.tokens[: len(o2.prompt_ids) - len(traj.prompt_ids)]
    assert traj.tokens[-n2:] == o2.token_ids and sum(traj.mask) == n1 + n2


def test_deeply_nested_arguments_in_a_request_are_read_as_text(tokenizer: Any) -> None:
    """An agent's assistant message whose arguments nest too deep for the JSON reader was a 500 (RecursionError
    where the session compares and renders them), which clients retry."""
    call = {"id": "c", "type": "function", "function": {"name": "run", "arguments": "[" * 5000}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "c", "content": "ok"})
    sessions, server = serve(RecordingEngine(tokenizer, ["ok"]), tokenizer)
    try:
        sessions.open("d", PARAMS, LIMITS)
        body = json.dumps({"messages": messages, "tools": TOOLS}).encode()
        status, answer = post_json(server.base_url("d") + "/chat/completions", body)
        sessions.close("d")
    finally:
        server.close()
    assert status == 200 and answer["choices"][0]["message"]["content"] == "ok", answer
