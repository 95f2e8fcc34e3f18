"""Thousands written with spaces, read as one number only where the grouping is certain: one rule for the math
grader (roll_envs.rewards.math) and `roll_envs.numeric.parse_number` (the environments' answers, agentic.tool_env).

`join_digit_groups(text)` removes the separators of each run of digit groups that is a thousands grouping: a first
group of one to three digits, then groups of exactly three, each after one separator (a plain, no-break, thin or
narrow no-break space, LaTeX `\\,`, `\\!`, `\\ ` or `~`): `5 000`, `1 234 567`, `5\\,000`, `-1 234.5` become `5000`,
`1234567`, `5000`, `-1234.5`. The run is the whole stretch of numbers apart by such separators, so two numbers side
by side are never merged: `3 4`, `1234 567` (a first group of four), `10 20 300` (three numbers, though `20 300`
alone would be a grouping) and `2023 100` stay as they are. Neither is a run that continues a number or a symbol
(after a digit, a letter, `.`, `,`, `^` or `_`: `3.141 592`, `x_1 234`, `a^2 345`) or that a comma and a digit follow
(`1 234,5`: a decimal comma or a list, no one number), nor one that a decimal exponent follows, after its decimals
or not (`1 000e5`, `1 234.5E-3`: a thousands grouping and an exponent, which no one writes, are no one number, as
roll_envs.numeric refuses `1,000e5`; it was read as 1000e5). A comma between digits is untouched (`1,000` is
roll_envs.numeric's business).

`numbers_side_by_side(text)` finds the runs of numbers apart by spacing that `join_digit_groups` leaves: no one
number, which a grader must not hand to math-verify (it reads `3 4` as 7, `10 20 300` as 330, `5 00` as 5*0, `3 1/2`
as (3+1)/2 and `1 234,5` as {235, 5}: `\\boxed{5 00}` was right against 0). Spacing here is any of white space (a
line break too), `\\,`, `\\;`, `\\:`, `\\!`, `\\ `, `~`, `\\quad` and `\\qquad`, one or several (`5  000`); runs
that continue a number or a symbol (as above: `3.141 592`, `x_1 234`), that are an index or power in braces
(`a_{1 2}`) or the brace-less arguments of `\\frac`, `\\binom` or `\\sqrt` (`\\frac 1 2` is 1/2) are not such runs.
Pure Python.
"""

from __future__ import annotations

import re

#: One separator between digit groups.
_SEP = r"(?:[ \u00a0\u2009\u202f~]|\\[,!]|\\ )"
#: A run of at least two digit groups apart by separators, not continuing a number or a symbol.
_RUN = re.compile(rf"(?<![\w.,^])(?<!\d[ \u00a0\u2009\u202f~])(?<!\d\\[,!])(?<!\d\\ )\d+(?:{_SEP}\d+)+")
_SEPS = re.compile(_SEP)
#: A run followed by a comma and a digit is no one number (`1 234,5`).
_COMMA_DIGIT = re.compile(r",\d")
#: A decimal exponent after a run, after its decimals or not (`e5`, `.5E-3`): the run is no one number.
_EXPONENT = re.compile(r"(?:\.\d*)?[eE][-+]?\d+")
#: Spacing math-verify reads numbers side by side across (`numbers_side_by_side`).
_SPACING = r"(?:\s|\\[,;:! ]|~|\\q?quad(?![a-zA-Z]))"
#: The longest stretch of numbers apart by spacing (it starts at a run's first digit: the stretch before it took
#: any digit and spacing before it).
_STRETCH = re.compile(rf"(?<!\d)\d+(?:{_SPACING}+\d+)+")
#: A character before a stretch that it continues (a number or a symbol), as `_RUN`'s look-behind.
_CONTINUES = re.compile(r"[\w.,^]")
#: What before a stretch makes it no run of numbers: an index or power in braces, or a command whose brace-less
#: arguments the digits are (`\frac 1 2`), then spacing.
_ARGUMENTS = re.compile(rf"(?:[_^]\{{|\\(?:[dtc]?frac|[dt]?binom|sqrt)(?![a-zA-Z])){_SPACING}*$")


def join_digit_groups(text: str) -> str:
    """`text` with each thousands grouping written with spaces as plain digits (module docstring); other runs of
    numbers apart by spaces unchanged."""

    def join(m: re.Match[str]) -> str:
        return "".join(_SEPS.split(m.group())) if _joins(text, m) else m.group()

    return _RUN.sub(join, text)


def numbers_side_by_side(text: str) -> list[tuple[int, int]]:
    """The (start, end) spans of the runs of numbers apart by spacing in `text` that `join_digit_groups` does not
    make one number (module docstring: `5 00`, `3 4`, `1 000e5`'s `1 000`, `5  000`), which math-verify reads as a
    sum or a product of their numbers; a thousands grouping it joins (`1 000`) is none."""
    joined = {m.span() for m in _RUN.finditer(text) if _joins(text, m)}
    spans = []
    for m in _STRETCH.finditer(text):
        start = m.start()
        if _CONTINUES.match(text, start - 1) if start else False:
            continue  # continues a number or a symbol (`3.141 592`, `x_1 234`), as `_RUN`
        # (A bounded look back: spacing longer than that before the digits is no argument anyway.)
        if _ARGUMENTS.search(text[max(0, start - 40) : start]) or m.span() in joined:
            continue
        spans.append(m.span())
    return spans


def _joins(text: str, m: re.Match[str]) -> bool:
    """Whether the run `m` of `_RUN` in `text` is one number: a grouping, no comma and digit or exponent after it."""
    if not _grouping(_SEPS.split(m.group())):
        return False
    return not (_COMMA_DIGIT.match(text, m.end()) or _EXPONENT.match(text, m.end()))


def grouped_exponents(text: str) -> list[tuple[int, int]]:
    """The (start, end) spans of the thousands groupings in `text` that a decimal exponent follows, the exponent
    included (`1 000e5`): no one number (module docstring), which a grader must not read as its last group (math-
    verify read `1 000e5` as 000e5, 0)."""
    spans = []
    for m in _RUN.finditer(text):
        exp = _EXPONENT.match(text, m.end())
        if exp is not None and _grouping(_SEPS.split(m.group())):
            spans.append((m.start(), exp.end()))
    return spans


def _grouping(groups: list[str]) -> bool:
    """Whether digit groups are a thousands grouping: one to three digits, then groups of exactly three."""
    return 1 <= len(groups[0]) <= 3 and all(len(g) == 3 for g in groups[1:])
