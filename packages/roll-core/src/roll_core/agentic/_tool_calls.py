"""Tool-call parsers of the agent endpoint (roll_core.agentic.openai_server re-exports them): one per model family,
each mapping a reply's text to roll_core.agentic.agent_sessions.ParsedReply (content and OpenAI `tool_calls`).

Hermes / Qwen (`HermesToolParser`): the blocks roll_core.agentic.hermes_syntax reads (its docstring says which are
calls, which are invalid and how they differ from vLLM's reading). The calls are served in order; the content is the
text without them (stripped; None when nothing is left), invalid blocks and all; a reply without calls is its
content as is. Invalid blocks are counted (`ParsedReply.invalid`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from roll_core.agentic._agent_turns import ParsedReply
from roll_core.agentic.hermes_syntax import CLOSE, OPEN, hermes_blocks


class HermesToolParser:
    """Qwen2.5 / Qwen3 / Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (see
    the module docstring)."""

    #: Tokens the reply text must keep for this parser (see `text_decoder`).
    markers: tuple[str, ...] = (OPEN, CLOSE)

    def __call__(self, text: str) -> ParsedReply:
        blocks = hermes_blocks(text)
        calls = [b.call for b in blocks if b.call is not None]
        if not calls:
            return ParsedReply(text, [], len(blocks))
        kept: list[str] = []
        last = 0  # end of the last call
        for b in blocks:
            if b.call is not None:
                kept.append(text[last : b.start])
                last = b.end
        content = ("".join(kept) + text[last:]).strip()
        return ParsedReply(content or None, calls, len(blocks) - len(calls))


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
