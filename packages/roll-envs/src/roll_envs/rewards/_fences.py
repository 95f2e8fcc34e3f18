"""Markdown (CommonMark) backtick fences of a response: `fenced_blocks(text) -> [(tag, body), ...]`.

Contract (what `roll_envs.rewards.code.extract_code` reads a program from):
- An opening fence is N >= 3 backticks and an info string without backticks, indented by at most 3 spaces past
  the content column of the list item it is in (0 outside lists). A list item is a `-`, `+` or `*` marker, or 1-9
  digits and `.` or `)`, indented at most 3 spaces past its own container's column and followed by 1-4 spaces
  (its content column is there), by 5 or more (content column one past the marker) or by the line's end. A fence
  may follow the marker on its line (`1. ```python`). Items nest; a line indented less than an item's content
  column closes it unless it is a paragraph's lazy continuation (text right after text); after text, only a
  non-empty bullet or `1.` / `1)` item starts a list, but any marker outdented below an open item's content
  column starts one (`1. Read n.` then `2. Print:` are two items). So `1. Read n:` then a fence indented 4
  spaces is a fence (1 past the item's column 3), and 3 spaces past `- ` (5) too.
- A line indented 4 or more spaces past its container that continues no paragraph is an indented code block: text,
  never a fence (a ```python line there, or code merely indented, is no program), as CommonMark renders it.
- The block ends at the next line holding only spaces (at most 3 past the opening's container column), >= N
  backticks and whitespace; a ``` elsewhere (a string literal, after code on a line) is part of the body. An
  unclosed block (a truncated response) is not returned and ends the scan (it holds the rest of the text). A body
  line indented less than the list item's content column does not end the block, where CommonMark would end the
  item and the block with it: a model's code line it forgot to indent stays in its program.
- Up to as many spaces as the opening fence is indented (its column, the item's content column included) are
  removed from each body line, so the program reads as written inside the list item.
- Indentation is spaces; tabs, block quotes and ~~~ fences are not read as Markdown structure.
"""

from __future__ import annotations

import re

# Matched against one line (or the part after a list marker) without its newline.
_OPEN_FENCE = re.compile(r"(`{3,})([^`]*)")
_CLOSE_FENCE = re.compile(r"( *)(`{3,})\s*")
_LIST_ITEM = re.compile(r"([-+*]|\d{1,9}[.)])( *)(.*)")
# Blocks that interrupt a paragraph and are not lazy continuation text (headings, thematic breaks).
_NOT_TEXT = re.compile(r"#{1,6}(?:\s|$)|([-*_])(?: *\1){2,} *$")
_TAG = re.compile(r"[A-Za-z0-9_+-]*")


def _indent(line: str, start: int = 0) -> int:
    """Column of the first non-space character of `line` at or after `start`."""
    return start + len(line[start:]) - len(line[start:].lstrip(" "))


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(lower-cased first word of the info string, body) of each complete fenced block, in order (module
    docstring)."""
    lines = text.split("\n")
    blocks: list[tuple[str, str]] = []
    items: list[int] = []  # content columns of the open list items, innermost last
    paragraph = False  # the previous line was paragraph text: a less indented text line continues it (lazily)
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip():
            paragraph = False
            continue
        col = _indent(line)
        depth = len(items)
        while depth and items[depth - 1] > col:
            depth -= 1
        # A lazy continuation line (text after text) keeps the items open. Whether it starts a block is judged
        # whatever its indentation, as markdown-it does: an outdented fence, marker or heading closes them.
        if depth < len(items) and paragraph and not _starts_block(line, col):
            continue
        # The "only a non-empty bullet or 1. interrupts text" rule is for a list starting inside the paragraph's
        # container; a marker outdented below an open item's content column closes that item (markdown-it's
        # rule): "1. Read n.\n2. Print:" are two items, and a fence under the second is its program.
        after_text = paragraph and depth == len(items)
        opened = _list_items(line, col, items[depth - 1] if depth else 0, after_text=after_text)
        base = opened[-1] if opened else items[depth - 1] if depth else 0
        col = _indent(line, base) if opened else col
        fence = _OPEN_FENCE.fullmatch(line, col) if col - base <= 3 else None
        items[depth:] = opened
        if fence is None:
            # Text (not an empty item, heading or break) starts or continues a paragraph; a line indented past
            # the container's 3 spaces continues one or is an indented code block (no paragraph).
            if col - base <= 3 or opened:
                paragraph = col - base <= 3 and col < len(line) and not _NOT_TEXT.match(line, col)
            continue
        ticks = len(fence.group(1))
        end = next(
            (
                j
                for j in range(i, len(lines))
                if (c := _CLOSE_FENCE.fullmatch(lines[j])) and len(c.group(1)) <= base + 3 and len(c.group(2)) >= ticks
            ),
            None,
        )
        if end is None:  # unclosed: it holds the rest of the text, fences included
            break
        body = "".join(text_line[min(col, _indent(text_line)) :] + "\n" for text_line in lines[i:end])
        tag = _TAG.match(fence.group(2).strip())
        blocks.append((tag.group().lower() if tag else "", body))
        i, paragraph = end + 1, False
    return blocks


def _starts_block(line: str, col: int) -> bool:
    """Whether `line` from `col` is an opening fence, a list marker, a heading or a thematic break."""
    return bool(_OPEN_FENCE.fullmatch(line, col) or _NOT_TEXT.match(line, col) or _list_items(line, col, col))


def _list_items(line: str, col: int, container: int, after_text: bool = False) -> list[int]:
    """Content columns of the list items whose markers open `line` at `col` (nested ones too, as `1. - x`),
    each marker at most 3 spaces past its container's column; [] when the line opens none. `after_text`: the line
    follows paragraph text, which only a non-empty bullet or `1.` / `1)` item interrupts ("in\n2024. it was")."""
    opened: list[int] = []
    while col - container <= 3 and (item := _LIST_ITEM.fullmatch(line, col)):
        gap, rest = len(item.group(2)), item.group(3)
        if (gap == 0 and rest) or _NOT_TEXT.fullmatch(line, col):  # "-x", "1.5"; "- - -" is a thematic break
            break
        ordered_not_one = item.group(1)[0].isdigit() and int(item.group(1)[:-1]) != 1
        if after_text and not opened and (not rest or ordered_not_one):
            break
        if not rest:  # an empty item: its content starts one past the marker
            opened.append(item.end(1) + 1)
            break
        container = item.end(1) + (gap if gap <= 4 else 1)  # 5+ spaces: the content is indented code
        opened.append(container)
        col = _indent(line, container)
    return opened
