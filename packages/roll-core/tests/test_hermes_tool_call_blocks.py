"""Hermes tool-call blocks read one by one (roll_core.agentic._tool_calls): a `<tool_call>` mentioned in prose or cut
off before the next block is one invalid block and the well-formed call after it is served; a call naming the empty
function is invalid. Parser-level, and through the session the agent's request goes to (its OpenAI reply and the
counted invalid calls). The same replies, well formed, against vLLM's own parser: test_hermes_vllm_parity.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from roll_core.agentic.agent_sessions import AgentSessions, ChatTurn, SessionLimits
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import HermesToolParser, text_decoder
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.agent_endpoint import ScriptedTextEngine

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64, seed=5)
LIMITS = SessionLimits(max_tokens_per_turn=64, max_context_length=2048)
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def _call(name: str, **args: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


LS = _call("ls", d="/")


@pytest.mark.parametrize(
    ("before", "content"),
    [
        # a bare opener in prose: it ran to the call's closing marker, one invalid block, the call lost
        ("I will emit <tool_call> now.\n", "I will emit <tool_call> now."),
        # a block cut off (not JSON up to the next opener): the same
        ('<tool_call>{"name": "ls", "arg\n', '<tool_call>{"name": "ls", "arg'),
        # a JSON value not followed by its closing marker before the next block
        ('<tool_call>{"name": "cat"} and then\n', '<tool_call>{"name": "cat"} and then'),
        # two openers in prose: each is invalid on its own
        ("<tool_call> or <tool_call>? ", "<tool_call> or <tool_call>?"),
    ],
)
def test_an_unclosed_opener_does_not_swallow_the_next_call(before: str, content: str) -> None:
    parsed = HermesToolParser()(before + LS)
    assert parsed.calls == [{"name": "ls", "arguments": '{"d": "/"}'}]
    assert parsed.invalid == before.count("<tool_call>") and parsed.content == content


def test_an_opener_inside_a_calls_strings_opens_nothing() -> None:
    """Only an opener outside the JSON read so far ends an invalid block (one in its strings is the argument's)."""
    bad = '<tool_call>{"name": "run", "arguments": {"s": "<tool_call>"}} junk</tool_call>'
    parsed = HermesToolParser()(bad + LS)
    assert [c["name"] for c in parsed.calls] == ["ls"] and parsed.invalid == 1 and parsed.content == bad


@pytest.mark.parametrize("name", ["", "  "])
def test_a_call_naming_no_function_is_invalid(name: str) -> None:
    """`{"name": ""}` was served as a call to the function "" (and counted valid)."""
    text = f"{_call(name, x=1)}{LS}"
    parsed = HermesToolParser()(text)
    assert [c["name"] for c in parsed.calls] == ["ls"] and parsed.invalid == 1
    assert parsed.content == _call(name, x=1)


def test_the_agent_gets_the_call_after_a_mentioned_opener(tokenizer: Any) -> None:
    """The per-request answer: the call as OpenAI `tool_calls`, the prose (with its opener) as content, and the
    invalid block counted for the session's metrics."""
    engine = ScriptedTextEngine(tokenizer, ["I will emit <tool_call> now.\n" + LS])
    decode = text_decoder(tokenizer, HermesToolParser.markers)  # as the agentic pipeline decodes replies
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), decode, HermesToolParser())
    sessions.open("p", PARAMS, LIMITS)
    reply = sessions.chat("p", ChatTurn(messages=list(HI), tools=TOOLS))
    session = sessions.close("p")
    assert reply.finish_reason == "tool_calls" and reply.message["content"] == "I will emit <tool_call> now."
    (call,) = reply.message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "ls", "arguments": '{"d": "/"}'}
    assert session.invalid_tool_calls == 1 and session.traj.tool_calls == 1
