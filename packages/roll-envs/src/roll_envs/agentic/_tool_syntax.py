"""Where the `<tool>NAME: ARGUMENT</tool>` calls of a reply are (roll_envs.agentic.tool_env's call syntax).

`find_calls(reply)` returns the reply's answer part (the text after its reasoning) and the `<tool>` blocks in it:
the first block's body (None when that block is never closed) and how many blocks there are.

The argument is free text, so it may hold the markers themselves (a program that prints `</tool>`): a block is not
cut at the first `</tool>` after it (that ran `print("` and reported a SyntaxError for a program the model wrote
correctly). A block ends at its balancing `</tool>` (a `<tool>` inside the argument opens a nested pair), extended to
the last `</tool>` before the next `<tool>` that follows it (a `</tool>` inside the argument with no `<tool>` before
it): `<tool>code: print("</tool>")</tool>` is the call `code: print("</tool>")`, and
`<tool>a: 1</tool> <tool>b: 2</tool>` are two blocks. A block whose `<tool>`s are never all balanced ends at the
last `</tool>` of the reply; one without any `</tool>` after it is unclosed. A call whose argument holds `</tool>`s,
balanced `<tool>`...`</tool>` pairs or only `<tool>`s is read as written; the syntax has no escape, so an argument
holding a `</tool>` and then a `<tool>` is cut at the `</tool>` (its program fails visibly), and a `</tool>` written
in prose after a call belongs to that call's argument.

The reasoning is the text up to the first `</think>` (a `<think>` before it, or none: a template whose generation
prompt opens the block) that is not inside a balanced `<tool>` block: a program that prints `</think>` does not end
the reasoning (its call was passed to the wrapped environment as an action, unrun), while a bare `<tool>` the
reasoning mentions hides nothing. A `<think>` outside such blocks that is never closed makes a reply cut off while
reasoning: it has no answer (None) and so no call; a `<think>` inside a call's argument opens nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from roll_core.thinking import THINK_CLOSE, reasoning_span

OPEN, CLOSE = "<tool>", "</tool>"
_MARKERS = re.compile(r"<tool>|</tool>")

__all__ = ["CLOSE", "OPEN", "Calls", "find_calls"]


@dataclass(frozen=True)
class Calls:
    """The `<tool>` blocks of a reply's answer part."""

    #: The reply after its reasoning; None for a reply cut off while reasoning.
    answer: str | None
    #: Number of `<tool>` blocks in the answer (closed or not); 0: the reply calls no tool.
    count: int = 0
    #: The first block's text between its markers; None when it has no closing marker.
    first: str | None = None


def _block_end(text: str, start: int, balanced: bool = False) -> int:
    """The index after the `</tool>` that ends the block opened at `start` (module docstring), -1 when none does
    (with `balanced`, also when its `<tool>`s are never all balanced)."""
    depth, end, last = 1, -1, -1
    for m in _MARKERS.finditer(text, start + len(OPEN)):
        if m.group(0) == OPEN:
            if depth == 0:  # the next block
                break
            depth += 1
        else:
            depth, last = max(depth - 1, 0), m.end()
            if depth == 0:
                end = last
    return end if end >= 0 or balanced else last


def _answer(text: str) -> str | None:
    """The text after the reasoning (module docstring). Markers inside a balanced `<tool>` block are the argument's;
    an unbalanced `<tool>` (one the reasoning mentions) hides nothing."""
    opening, close = reasoning_span(text, OPEN, lambda t, at: _block_end(t, at, balanced=True))
    if close >= 0:
        return text[close + len(THINK_CLOSE) :]
    return None if opening >= 0 else text


def find_calls(reply: str) -> Calls:
    """The reply's answer part and its `<tool>` blocks (module docstring)."""
    answer = _answer(reply)
    if answer is None:
        return Calls(None)
    start = answer.find(OPEN)
    if start < 0:
        return Calls(answer)
    end = _block_end(answer, start)
    first = answer[start + len(OPEN) : end - len(CLOSE)] if end >= 0 else None
    count = 1
    while end >= 0 and (start := answer.find(OPEN, end)) >= 0:
        count += 1
        end = _block_end(answer, start)
    return Calls(answer, count, first)
