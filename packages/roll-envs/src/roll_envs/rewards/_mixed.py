"""Mixed numbers in math answers, one reading for the grader's truths, boxed answers and stated numbers
(roll_envs.rewards.math): a whole number followed by a fraction is their sum, `3\\frac{1}{2}` = `3\\tfrac12` =
`3 1/2` = 7/2 (`-3\\frac{1}{2}` = -7/2), as MATH's answers write them (`2\\frac{1}{2}` means 2.5) and as
math-verify reads the LaTeX spelling (latex2sympy2_extended's `interpret_as_mixed_fractions`, on by default: an
integer followed by a positive rational is their sum; a product needs `2 \\cdot \\frac{1}{2}`).

- `MIXED` matches the LaTeX spelling at a position: digits, optional spacing, then `\\frac`, `\\dfrac`, `\\tfrac` or
  `\\cfrac` of two positive integers in braces, or `\\frac12` (two digits, brace-less). Any positive fraction, as
  math-verify: `3\\frac{7}{2}` is 6.5. `2\\frac{x}{2}` (letters) or a decimal before it (`0.5\\frac{1}{2}`) is no
  mixed number: math-verify reads those as products.
- `plain_as_latex(text)` writes the plain spelling `3 1/2` as `3\\frac{1}{2}`: a whole number, spacing (spaces, a
  no-break or thin space, `~`, `\\,` and the like; no line break), then a proper fraction `a/b` of positive integers
  (0 < a < b) that nothing continues (a letter, a digit, `(`, `^`, `/` glued after it; `3 1/2 cups` is a unit after
  it). math-verify read `3 1/2` as (3+1)/2 and the grader refused it as numbers side by side
  (roll_envs._digit_groups `numbers_side_by_side`). An improper `3 7/2` is no plain mixed number (no one writes one),
  nor is a run that continues a number or a symbol (`x_3 1/2`, `0.3 1/2`, `1/3 1/2`, `10 3 1/2`): those stay as
  written. Pure Python.
"""

from __future__ import annotations

import re
from fractions import Fraction

#: Spacing between the whole number and its LaTeX fraction (as math-verify reads `3 \frac{1}{2}`).
_LATEX_SPACING = r"(?:\s|\\[ ,;:!]|~)*"
_POSITIVE = r"0*[1-9]\d*"
MIXED = re.compile(
    rf"(?P<whole>\d+){_LATEX_SPACING}\\[dtc]?frac\s*"
    rf"(?:\{{\s*(?P<num>{_POSITIVE})\s*\}}\s*\{{\s*(?P<den>{_POSITIVE})\s*\}}|(?P<num1>[1-9])(?P<den1>[1-9])(?!\d))"
)
#: Spacing of the plain spelling: on one line.
_PLAIN_SPACING = r"(?:[ \t\u00a0\u2009\u202f~]|\\[ ,;:!])+"
_PLAIN = re.compile(
    r"(?<![\w.,^_/])(?<!\d[ \t\u00a0\u2009\u202f~])(?<!\d\\[ ,;:!])"
    rf"(?P<whole>\d+){_PLAIN_SPACING}(?P<num>{_POSITIVE})[ \t]*/[ \t]*(?P<den>{_POSITIVE})(?![\w(^/]|[.,]\d)"
)


def mixed_value(m: re.Match[str]) -> Fraction:
    """The (non-negative) value of a `MIXED` match: its whole number plus its fraction."""
    num, den = (m["num"], m["den"]) if m["num"] is not None else (m["num1"], m["den1"])
    return int(m["whole"]) + Fraction(int(num), int(den))


def plain_as_latex(text: str) -> str:
    """`text` with each plain mixed number (`3 1/2`, module docstring) written `3\\frac{1}{2}`; the rest unchanged."""

    def latex(m: re.Match[str]) -> str:
        num, den = int(m["num"]), int(m["den"])
        return f"{m['whole']}\\frac{{{num}}}{{{den}}}" if num < den else m.group()

    return _PLAIN.sub(latex, text) if "/" in text else text
