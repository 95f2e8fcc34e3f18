"""Where the Hermes / Qwen tool calls of a reply are: `hermes_blocks(text)` lists its `<tool_call>` blocks outside
its reasoning, each with its span and the call it makes (None for an invalid block). The agent endpoint's parser
(roll_core.agentic._tool_calls.HermesToolParser) and roll_envs' tool env (which takes this form as its own
`<tool>` call) read replies with it. Light: no server or engine imports.

A block is `<tool_call>` JSON `</tool_call>`, whitespace allowed inside.

- The JSON is read as JSON (to its end), not up to the first `</tool_call>`: an argument string that holds the
  closing marker (code that writes tool calls, a quoted transcript) is part of the call (it was an invalid block).
- Blocks inside the reply's reasoning (`<think>` ... `</think>`, or up to a `</think>` without an opening one, for
  templates whose generation header opens the block) are no calls and not counted: the model thinking about a call
  is not making it (vLLM's reasoning parser takes them out before its tool parser). They stay in the content.
  A `<think>` or `</think>` inside a block's JSON (a program that prints it) is the argument's text, not a reasoning
  marker: a call whose code held `</think>` was read as reasoning and dropped, uncounted, and one holding `<think>`
  dropped every later call of the reply.
- A block that does not parse (not JSON, nested too deep for the JSON reader, no name or an empty one, or
  arguments that are not a JSON object) stays in the content and counts as invalid, as does an opening marker with
  no closing one (a reply cut off by max_tokens), unless a whole JSON value ends the text after it (a request that
  stops on `</tool_call>`: the served text ends before its stop string), which is read as a block.
- Each block is read on its own: an invalid one ends at its closing marker or at the next opening marker, whichever
  comes first. A `<tool_call>` mentioned in prose, or a block cut off before the next one, is one invalid block and
  the well-formed call after it is served (vLLM's parser reads up to the next `</tool_call>` and fails the whole
  reply: 0 calls). For replies whose blocks are all well formed the calls are vLLM's, and so is the content where
  the reply has text only before its calls (stripped here; text between or after calls stays content here).
- A call names whatever function the model wrote, offered in the request's `tools` or not: the agent's answer to an
  unknown function (an error result) is what the policy learns from, as under vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from roll_core.thinking import THINK_CLOSE, reasoning_span

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder()
_SPACE = " \t\r\n"

__all__ = ["CLOSE", "OPEN", "HermesBlock", "hermes_blocks"]


@dataclass(frozen=True)
class HermesBlock:
    """One `<tool_call>` block of a reply: `text[start:end]` (from its opening marker to the end of its closing one,
    or to where the block stops: the next opening marker, the text's end)."""

    start: int
    end: int
    #: {"name", "arguments" (JSON text of an object)}; None: an invalid block (module docstring).
    call: dict[str, str] | None


def hermes_blocks(text: str) -> list[HermesBlock]:
    """The reply's `<tool_call>` blocks outside its reasoning, in order (module docstring)."""
    blocks: list[HermesBlock] = []
    think_start, think_end = _reasoning(text)
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        if think_start <= start < think_end:  # reasoning, not a call
            pos = think_end
            continue
        call, pos = _block(text, start + len(OPEN))
        blocks.append(HermesBlock(start, pos, call))
    return blocks


def _reasoning(text: str) -> tuple[int, int]:
    """[start, end) of the reply's reasoning block ((0, 0) without one): `<think>` to the end of its `</think>`, to
    the text's end when the block is not closed (cut off), from the start for a `</think>` with no opening one.
    Markers inside a block's JSON value (one followed by `</tool_call>`, or ending the text) are skipped."""
    opening, close = reasoning_span(text, OPEN, lambda t, at: _value(t, at + len(OPEN))[1])
    if close < 0:
        return (opening, len(text)) if opening >= 0 else (0, 0)
    if opening < 0:
        opening = 0
    return opening, close + len(THINK_CLOSE)


def _value(text: str, body: int) -> tuple[Any, int, int]:
    """(the JSON value starting at `body` (after whitespace), the index after the block's `</tool_call>` or -1 when
    the value is not followed by one, the index after the value or -1 when there is no JSON value)."""
    i = body
    while i < len(text) and text[i] in _SPACE:
        i += 1
    try:
        obj, j = _JSON.raw_decode(text, i)
    except (ValueError, RecursionError):  # deep nesting raised past the parser: a 500 and an unrecorded turn
        return None, -1, -1
    after = j
    while j < len(text) and text[j] in _SPACE:
        j += 1
    if text.startswith(CLOSE, j):
        return obj, j + len(CLOSE), after
    if j == len(text):
        # A whole JSON value that ends the text: the closing marker was the request's stop string (cut off the
        # served text, as OpenAI's contract says), or the budget ran out after the value. vLLM's parser takes
        # it as well; every call of an agent that stops on `</tool_call>` was an invalid block.
        return obj, j, after
    return None, -1, after


def _block(text: str, body: int) -> tuple[dict[str, str] | None, int]:
    """(the call, or None for an invalid block; where the block ends) of the block whose JSON starts at `body`."""
    obj, end, after = _value(text, body)
    if end >= 0:
        return _call_of(obj), end
    # Not one JSON value followed by the closing marker: invalid. It runs to the next closing marker (searched after
    # the value, when there is one: a marker inside its strings is no end), unless an opening marker comes first:
    # then it ends there, and the block that opens is read on its own (a `<tool_call>` mentioned in prose, or one
    # cut off, took the valid call after it into one invalid block). With neither, it runs to the text's end.
    search = body if after < 0 else after
    close, following = text.find(CLOSE, search), text.find(OPEN, search)
    if following >= 0 and (close < 0 or following < close):
        return None, following
    return None, (len(text) if close < 0 else close + len(CLOSE))


def _call_of(obj: Any) -> dict[str, str] | None:
    """{"name", "arguments" (JSON text of an object)} of one block's JSON value, None when it is not a call.

    OpenAI's `arguments` is the JSON text of an object: a block whose arguments are anything else (`5`, `[1]`,
    `"[1]"`, `null`) is no call (it was served as f("5"), uncounted); missing arguments are `{}`. Arguments the
    model wrote as an object are served as JSON text with their characters as written (not `\\u` escapes), as vLLM
    serves them."""
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not name.strip():  # `""` names no function (it was served as a call)
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except (ValueError, RecursionError):
            return None
        return {"name": name, "arguments": args}
    if not isinstance(args, dict):
        return None
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
