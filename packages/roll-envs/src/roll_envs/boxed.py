"""The last `\\boxed{...}` of a text: one rule for rewards (roll_envs.rewards.math) and environments
(roll_envs.agentic). Pure Python, so environment workers import it without torch."""

from __future__ import annotations

import re

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, stripped, or None."""
    starts = [m.end() for m in _BOX_START.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None  # unbalanced: treated as no answer
