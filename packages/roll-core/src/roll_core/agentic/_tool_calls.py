"""Tool-call parsers of the agent endpoint (roll_core.agentic.openai_server re-exports them): one per model family,
each mapping a reply's text to roll_core.agentic.agent_sessions.ParsedReply (content and OpenAI `tool_calls`).

Hermes / Qwen (`HermesToolParser`): a block is `<tool_call>` JSON `</tool_call>`, whitespace allowed inside.

- The JSON is read as JSON (to its end), not up to the first `</tool_call>`: an argument string that holds the
  closing marker (code that writes tool calls, a quoted transcript) is part of the call (it was an invalid block).
- Blocks inside the reply's reasoning (`<think>` ... `</think>`, or up to a `</think>` without an opening one, for
  templates whose generation header opens the block) are no calls and not counted: the model thinking about a call
  is not making it (vLLM's reasoning parser takes them out before its tool parser). They stay in the content.
  A `<think>` or `</think>` inside a block's JSON (a program that prints it) is the argument's text, not a reasoning
  marker: a call whose code held `</think>` was read as reasoning and dropped, uncounted, and one holding `<think>`
  dropped every later call of the reply.
- A block that does not parse (not JSON, nested too deep for the JSON reader, no name, or arguments that are not a
  JSON object) stays in the content and counts as invalid, as does an opening marker with no closing one (a reply
  cut off by max_tokens), unless a whole JSON value ends the text after it (a request that stops on
  `</tool_call>`: the served text ends before its stop string), which is read as a block.
- A call names whatever function the model wrote, offered in the request's `tools` or not: the agent's answer to an
  unknown function (an error result) is what the policy learns from, as under vLLM.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

from roll_core.agentic._agent_turns import ParsedReply
from roll_core.thinking import THINK_CLOSE, reasoning_span

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder()
_SPACE = " \t\r\n"


class HermesToolParser:
    """Qwen2.5 / Qwen3 / Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (see
    the module docstring)."""

    #: Tokens the reply text must keep for this parser (see `text_decoder`).
    markers: tuple[str, ...] = (_OPEN, _CLOSE)

    def __call__(self, text: str) -> ParsedReply:
        calls: list[dict[str, str]] = []
        invalid = 0
        kept: list[str] = []
        last = 0  # end of the last kept call
        think_start, think_end = _reasoning(text)
        pos = 0
        while (start := text.find(_OPEN, pos)) >= 0:
            if think_start <= start < think_end:  # reasoning, not a call
                pos = think_end
                continue
            body = start + len(_OPEN)
            call, end = _block(text, body)
            if end < 0:
                # No closing marker: this and every later opening one are cut-off blocks (max_tokens), counted
                # from here, not as opens minus closes (a stray `</tool_call>` cancelled an invalid block).
                invalid += sum(1 for i in _opens(text, start) if not think_start <= i < think_end)
                break
            pos = end
            if call is None:
                invalid += 1  # left in the content below
                continue
            kept.append(text[last:start])
            last = end
            calls.append(call)
        content = ("".join(kept) + text[last:]).strip() if calls else text
        return ParsedReply(content if content or not calls else None, calls, invalid)


def _reasoning(text: str) -> tuple[int, int]:
    """[start, end) of the reply's reasoning block ((0, 0) without one): `<think>` to the end of its `</think>`, to
    the text's end when the block is not closed (cut off), from the start for a `</think>` with no opening one.
    Markers inside a block's JSON value (one followed by `</tool_call>`, or ending the text) are skipped."""
    opening, close = reasoning_span(text, _OPEN, lambda t, at: _value(t, at + len(_OPEN))[1])
    if close < 0:
        return (opening, len(text)) if opening >= 0 else (0, 0)
    if opening < 0:
        opening = 0
    return opening, close + len(THINK_CLOSE)


def _opens(text: str, start: int) -> list[int]:
    out = []
    while (start := text.find(_OPEN, start)) >= 0:
        out.append(start)
        start += len(_OPEN)
    return out


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
    if text.startswith(_CLOSE, j):
        return obj, j + len(_CLOSE), after
    if j == len(text):
        # A whole JSON value that ends the text: the closing marker was the request's stop string (cut off the
        # served text, as OpenAI's contract says), or the budget ran out after the value. vLLM's parser takes
        # it as well; every call of an agent that stops on `</tool_call>` was an invalid block.
        return obj, j, after
    return None, -1, after


def _block(text: str, body: int) -> tuple[dict[str, str] | None, int]:
    """(the call, or None for an invalid block; the index after its `</tool_call>`, -1 when none follows) of the
    block whose JSON starts at `body`."""
    obj, end, after = _value(text, body)
    if end >= 0:
        return _call_of(obj), end
    # Not one JSON value followed by the closing marker: the block runs to the next closing marker (after the
    # value, when there is one: a marker inside its strings is no end), invalid.
    close = text.find(_CLOSE, body if after < 0 else after)
    return None, (-1 if close < 0 else close + len(_CLOSE))


def _call_of(obj: Any) -> dict[str, str] | None:
    """{"name", "arguments" (JSON text of an object)} of one block's JSON value, None when it is not a call.

    OpenAI's `arguments` is the JSON text of an object: a block whose arguments are anything else (`5`, `[1]`,
    `"[1]"`, `null`) is no call (it was served as f("5"), uncounted); missing arguments are `{}`. Arguments the
    model wrote as an object are served as JSON text with their characters as written (not `\\u` escapes), as vLLM
    serves them."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except (ValueError, RecursionError):
            return None
        return {"name": obj["name"], "arguments": args}
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


class NoToolParser:
    """Tool calls stay text (models without a tool-call syntax)."""

    def __call__(self, text: str) -> ParsedReply:
        return ParsedReply(text)


PARSERS: dict[str, type] = {"hermes": HermesToolParser, "qwen": HermesToolParser, "none": NoToolParser}


def text_decoder(tokenizer: Any, keep: tuple[str, ...] = ()) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, except that the tokens named in `keep` (a tool-call
    parser's `markers`) stay in the text: a tokenizer that marks `<tool_call>` special would otherwise drop it, and
    every tool call of the run would reach the agent as plain content."""
    unk = getattr(tokenizer, "unk_token_id", None)
    kept = {i for i in map(tokenizer.convert_tokens_to_ids, keep) if isinstance(i, int) and i != unk}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
    if not kept & special:  # nothing to keep that the plain decode would drop
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    drop = special - kept
    return lambda ids: tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)


def tool_parser(name: str) -> Callable[[str], ParsedReply]:
    """The parser of a model family by name (`PARSERS`), or `module:Class` (a class called with no arguments whose
    instances map text to roll_core.agentic.agent_sessions.ParsedReply)."""
    if name in PARSERS:
        return PARSERS[name]()
    module, _, cls = name.partition(":")
    if not cls:
        raise ValueError(f"tool parser {name!r}: one of {sorted(PARSERS)} or module:Class")
    return getattr(importlib.import_module(module), cls)()
