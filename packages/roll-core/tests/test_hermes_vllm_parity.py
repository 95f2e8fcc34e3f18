"""The agent endpoint's Hermes parser against vLLM's own (`Hermes2ProToolParser`, what a vLLM server answers an
agent with) on well-formed replies: the same calls, names and argument text alike, and the same content where the
reply has text only before its calls (vLLM's keeps its trailing space; roll's is stripped). Runs in vLLM's venv
(skipped in the main one). Replies vLLM fails as a whole (a `<tool_call>` in prose before a call: 0 calls) are
roll's own reading: test_hermes_tool_call_blocks.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")

from roll_core.agentic.openai_server import HermesToolParser
from roll_core.models import build_tiny_tokenizer


def _call(name: str, sep: str = "", **args: Any) -> str:
    return f"<tool_call>{sep}{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}{sep}</tool_call>"


WELL_FORMED = [
    _call("ls", d="/"),
    "Let me add. " + _call("add", a=3, b=4),
    _call("ls") + "\n" + _call("cat", path="a b", n=[1, {"x": None}]),
    "Sure:\n" + _call("run", "\n", code="print('{}')", q="café ☃"),
    "Listing. " + _call("ls", d="/")[: -len("</tool_call>")],  # a request stopped on `</tool_call>`
]


@pytest.mark.parametrize("text", WELL_FORMED)
def test_well_formed_replies_read_as_vllm_reads_them(text: str) -> None:
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    theirs = Hermes2ProToolParser(build_tiny_tokenizer()).extract_tool_calls(text, None)
    ours = HermesToolParser()(text)
    assert theirs.tools_called and ours.invalid == 0
    assert ours.calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in theirs.tool_calls]
    assert ours.content == ((theirs.content or "").strip() or None)
