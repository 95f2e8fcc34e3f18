"""The Hermes tool-call parser (roll_core.agentic._tool_calls) reads `<think>` / `</think>` written inside a call's
JSON (a program that prints them) as the argument's text, not as reasoning markers: a call holding `</think>` was
read as reasoning and dropped (not even counted invalid), and one holding `<think>` dropped every later call of
the reply. Real reasoning markers still hide the calls made while thinking."""

from __future__ import annotations

import json
from typing import Any

import pytest

from roll_core.agentic._tool_calls import HermesToolParser


def _call(name: str, **args: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        # no reasoning at all: the markers are the program's text
        (_call("py", code="print('</think>')"), [("py", {"code": "print('</think>')"})]),
        (
            _call("py", code="print('<think>')") + "\n" + _call("ls", path="/"),
            [("py", {"code": "print('<think>')"}), ("ls", {"path": "/"})],
        ),
        # after real reasoning, and a `</tool_call>` in the argument too
        (
            "<think>print it</think>\n" + _call("py", code="s = '</think></tool_call><think>'"),
            [("py", {"code": "s = '</think></tool_call><think>'"})],
        ),
        # a template whose generation header opens the reasoning: only its end is sampled
        (
            "use py</think>" + _call("py", code="print('</think>')") + _call("ls"),
            [("py", {"code": "print('</think>')"}), ("ls", {})],
        ),
        # a call made while thinking, whose argument holds `</think>`, is still thinking
        (f"<think>maybe {_call('rm', path='</think>')} no</think>\n\n{_call('ls')}", [("ls", {})]),
    ],
)
def test_think_markers_inside_a_calls_json_are_its_text(text: str, calls: list[tuple[str, dict]]) -> None:
    parsed = HermesToolParser()(text)
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed.calls] == calls
    assert parsed.invalid == 0


def test_reasoning_markers_outside_calls_still_hide_the_calls_made_while_thinking() -> None:
    text = f"<think>I could {_call('rm', path='/')}</think>\nNo."
    parsed = HermesToolParser()(text)
    assert parsed.calls == [] and parsed.invalid == 0 and parsed.content == text
    cut = f"<think>I could {_call('rm', path='/')} and then"  # cut off while thinking
    assert HermesToolParser()(cut).calls == []
