"""Framing markers in untrusted text: `defang` rewrites them so that the text cannot close its frame.

roll puts untrusted text (a tool's output, a wrapped environment's observation, a reply a judge grades) between
markers of its own (`<tool_output>` ... `</tool_output>`, `[Response]` ... `[End of response]`). Text that holds one
of those markers could close its frame early and write what follows as if it were the frame's own (a fake budget
line, a fake reference answer). `defang(text, markers)` writes each marker found in `text` (any case) with its
first and last characters replaced by parentheses: `</tool_output>` becomes `(/tool_output)`, `[End of response]`
becomes `(End of response)`; the text keeps its length, and nothing else changes. With `inner_spaces=True` a marker
is also found with whitespace after its opening bracket, around a `/` that follows it and before its closing bracket
(`< /TOOL_OUTPUT >`), as a reader would still take it for the marker.

A marker is at least three characters long and its first and last characters are neither letters, digits,
whitespace nor parentheses (a marker written in parentheses would be unchanged by the rewrite): a ValueError
otherwise.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

__all__ = ["defang"]


def _check(marker: str) -> None:
    ends = (marker[:1], marker[-1:])
    if len(marker) < 3 or any(c.isalnum() or c.isspace() or c in "()" for c in ends):
        raise ValueError(
            f"framing marker {marker!r}: need at least 3 characters, bracketed by characters other than letters, "
            "digits, whitespace and parentheses (e.g. <tag>, [Field])"
        )


def _source(marker: str, inner_spaces: bool) -> str:
    if not inner_spaces:
        return re.escape(marker)
    head, body, tail = marker[0], marker[1:-1].strip(), marker[-1]
    slash = ""
    if body.startswith("/"):
        slash, body = r"/\s*", body[1:].lstrip()
    return rf"{re.escape(head)}\s*{slash}{re.escape(body)}\s*{re.escape(tail)}"


@functools.lru_cache(maxsize=64)
def _pattern(markers: tuple[str, ...], inner_spaces: bool) -> re.Pattern[str] | None:
    for marker in markers:
        _check(marker)
    if not markers:
        return None
    # Longest first: a marker that begins another one must not match in its place.
    ordered = sorted(set(markers), key=len, reverse=True)
    return re.compile("|".join(_source(m, inner_spaces) for m in ordered), re.IGNORECASE)


def defang(text: str, markers: Sequence[str], *, inner_spaces: bool = False) -> str:
    """`text` with each of `markers` it holds (any case; with `inner_spaces`, whitespace inside the brackets too)
    written with parentheses for its first and last characters (module docstring).

    Raises:
        ValueError: a marker that is too short or not bracketed (module docstring).
    """
    pattern = _pattern(tuple(markers), inner_spaces)
    if pattern is None:
        return text
    return pattern.sub(lambda m: f"({m.group(0)[1:-1]})", text)
