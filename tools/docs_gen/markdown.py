"""Small helpers that put source text into generated markdown safely (table cells, headings, anchors)."""

from __future__ import annotations

import html
import re


def inline(text: str) -> str:
    """Source prose as inline markdown: `code spans` kept verbatim, everything else escaped so that `<schema>`,
    `a * b * c` or `[x]` show as written instead of becoming HTML, emphasis or links. Unbalanced backticks are
    escaped too (one stray backtick would swallow the rest of the cell)."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an odd number of backticks: none of them opens a code span
        return _escape(text).replace("`", "\\`")
    out = []
    for i, part in enumerate(parts):
        out.append(f"`{part}`" if i % 2 else _escape(part))
    return "".join(out)


def _escape(text: str) -> str:
    text = html.escape(text, quote=False)
    return re.sub(r"([\\*_\[\]|#])", r"\\\1", text)


def cell(text: str) -> str:
    """A table cell: inline markdown on one line (pipes inside code spans are kept by the tables extension)."""
    return inline(" ".join(text.split()))


def code(value: str) -> str:
    """A value as a code span, whatever backticks it holds."""
    value = " ".join(str(value).split())
    if "`" not in value:
        return f"`{value}`"
    return f"`` {value} ``"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table from cells that are already markdown."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def slug(text: str) -> str:
    """A file-name and anchor friendly form of a group or node name ("env/reward" -> "env-reward")."""
    return re.sub(r"[^a-z0-9_]+", "-", text.lower()).strip("-")
