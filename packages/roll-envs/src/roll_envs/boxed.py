"""The last `\\boxed{...}` of a text: one rule for rewards (roll_envs.rewards.math) and environments
(roll_envs.agentic). Pure Python, so environment workers import it without torch.

A box is `\\boxed{...}` or `\\fbox{...}` (braces balanced), or `\\boxed` followed by white space and the answer
without braces, `\\boxed 5`, as the MATH reference extractor (`last_boxed_only_string`) reads it and LaTeX typesets
it. That answer ends at white space, a `$` or a `}` closing a brace opened before it (`$\\boxed 5$`,
`\\boxed{\\boxed 5}`); a sentence's `.`, `,`, `;`, `:` or `?` after it is not part of it (`is \\boxed 5.`; a `!`
stays: `\\boxed 5!` is a factorial).
The last box is the one read, whatever its form: in `\\boxed{2} ... so the final answer is \\boxed 5` the answer
is `5`. Escaped braces, `\\{` and `\\}`, are characters of the answer (a set, `\\left\\{x\\right.`), never braces
that open or close the box.
"""

from __future__ import annotations

import re

#: A box: `\boxed{`/`\fbox{` (group `brace`), or `\boxed` with white space before a brace-less answer.
_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*(?P<brace>\{)|\\boxed\s+(?=[^\s{}$])")
#: A box holding nothing but boxes, braces and space (`\\boxed{\\boxed{}}`) is empty: it states no answer.
_ONLY_BOXES = re.compile(r"(?:\\(?:boxed|fbox)|[\s{}])*")
#: Sentence punctuation after a brace-less answer (`the answer is \boxed 5.`).
_SENTENCE_END = ".,;:?"


def extract_boxed(text: str) -> str | None:
    """Content of the last non-empty box (module docstring: `\\boxed{...}`, `\\fbox{...}` or `\\boxed 5`),
    stripped; "" when every box is empty (a box of empty boxes, `\\boxed{\\boxed{}}`, is empty too); None without
    a box, or when the braced box read is unbalanced (a truncated answer).

    Empty boxes are passed over: prompts say "put the final answer in \\boxed{}", and a reply that repeats that
    after its answer still answered."""
    starts = [(m.end(), m["brace"] is not None) for m in _BOX_START.finditer(text)]
    if not starts:
        return None
    for start, braced in reversed(starts):
        content = _balanced(text, start) if braced else _unbraced(text, start)
        if content is None:
            return None  # unbalanced: treated as no answer
        if not _ONLY_BOXES.fullmatch(content):
            return content
    return ""


def _balanced(text: str, start: int) -> str | None:
    """The stripped text from `start` to the brace closing the one just before it, or None if none closes it.
    An escaped brace (`\\{`, `\\}`) is a character, not a brace: the character after a backslash is skipped."""
    depth, i = 1, start
    while i < len(text):
        if text[i] == "\\":
            i += 2  # `\{`, `\}`, and `\\` (so that `\\{` is a line break and then a real brace)
            continue
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
        i += 1
    return None


def _unbraced(text: str, start: int) -> str:
    """A brace-less answer from `start`: up to white space, a `$`, or a `}` closing a brace opened before `start`
    (escaped braces skipped as in `_balanced`), less sentence punctuation at its end."""
    depth, i = 0, start
    while i < len(text) and not text[i].isspace() and text[i] != "$":
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                break
            depth -= 1
        i += 1
    return text[start : min(i, len(text))].rstrip(_SENTENCE_END)
