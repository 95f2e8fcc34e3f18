"""Numeric answers compared exactly: one rule for rewards (roll_envs.rewards.math) and environments
(roll_envs.agentic.tool_env). Pure Python.

`numbers_equal(a, b)` parses both as decimals (thousands separators and surrounding space removed) into exact
fractions: integers must be equal (a float cannot tell 469401340152858661 from ...662: above 2^53 neighbours
round to one double), other values may differ by less than 1e-9 (as before, for answers written to more or fewer
decimals). Raises ValueError when either is not a plain decimal number. A comma is a thousands separator only
between groups of three digits (`1,000`, `12,345.6`): `1,5` (a decimal comma) or `1,00` is no plain number,
never read as 15 or 100. A decimal exponent (`1e-5`, `1.5E3`, as Python's str() writes floats) is part of the
number, up to `MAX_EXPONENT` (a larger one is a ValueError: its exact value would take too long to compute); not
after a comma thousands separator. Thousands written with spaces are joined by the math grader's rule
(roll_envs._digit_groups `join_digit_groups`, so the grader and the environments agree): `5 000`, `1 234 567`,
`5\\,000`, `-1 234.5` are one number; `3 4`, `1234 567`, `5 00`, `1 234,5` or `1 000e5` are no plain number
(ValueError).
"""

from __future__ import annotations

import re
from fractions import Fraction

from roll_envs._digit_groups import join_digit_groups

_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+))?")
_GROUPED = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_TOLERANCE = Fraction(1, 10**9)
#: Largest decimal exponent read: `1e999999999` would be a billion-digit integer.
MAX_EXPONENT = 1000


def parse_number(text: str) -> Fraction:
    """`text` as an exact fraction ("1,234.50" -> 2469/2, "5 000" -> 5000); ValueError when it is not a plain
    decimal number (module docstring)."""
    t = join_digit_groups(text.strip())
    if "," in t:
        if not _GROUPED.fullmatch(t):
            raise ValueError(f"not a plain decimal number (a comma only between groups of three digits): {text!r}")
        t = t.replace(",", "")
    m = _DECIMAL.fullmatch(t)
    if m is None:
        raise ValueError(f"not a plain decimal number: {text!r}")
    if m["exp"] is not None and abs(int(m["exp"])) > MAX_EXPONENT:
        raise ValueError(f"exponent of {text[:40]!r} is beyond {MAX_EXPONENT}")
    return Fraction(t)


def numbers_equal(a: str, b: str) -> bool:
    """Whether two decimal numbers are the same answer (module docstring); ValueError for non-numbers."""
    return fractions_equal(parse_number(a), parse_number(b))


def fractions_equal(x: Fraction, y: Fraction) -> bool:
    """`numbers_equal`'s rule for exact values: integers equal, anything else within 1e-9."""
    if x.denominator == 1 and y.denominator == 1:
        return x == y
    return abs(x - y) < _TOLERANCE
