"""The last `\\boxed{...}` of a text: one rule for rewards (roll_envs.rewards.math) and environments
(roll_envs.agentic). Pure Python, so environment workers import it without torch."""

from __future__ import annotations

import re

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
#: A box holding nothing but boxes, braces and space (`\\boxed{\\boxed{}}`) is empty: it states no answer.
_ONLY_BOXES = re.compile(r"(?:\\(?:boxed|fbox)|[\s{}])*")


def extract_boxed(text: str) -> str | None:
    """Content of the last non-empty `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, stripped; "" when every
    box is empty (a box of empty boxes, `\\boxed{\\boxed{}}`, is empty too); None without a box, or when the box
    read is unbalanced (a truncated answer).

    Empty boxes are passed over: prompts say "put the final answer in \\boxed{}", and a reply that repeats that
    after its answer still answered."""
    starts = [m.end() for m in _BOX_START.finditer(text)]
    if not starts:
        return None
    for start in reversed(starts):
        content = _balanced(text, start)
        if content is None:
            return None  # unbalanced: treated as no answer
        if not _ONLY_BOXES.fullmatch(content):
            return content
    return ""


def _balanced(text: str, start: int) -> str | None:
    """The stripped text from `start` to the brace closing the one just before it, or None if none closes it."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None
