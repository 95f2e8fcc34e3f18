"""`join_digit_groups`, `grouped_exponents` and `numbers_side_by_side`, the math grader's rule for thousands written
with spaces and numbers side by side: it lives in roll_envs._digit_groups, shared with
`roll_envs.numeric.parse_number` (one rule for rewards and environments); re-exported here. `side_by_side_at`
applies the rule to one line of prose (the math reward's `last_number`)."""

from __future__ import annotations

from roll_envs._digit_groups import grouped_exponents, join_digit_groups, numbers_side_by_side

__all__ = ["grouped_exponents", "join_digit_groups", "numbers_side_by_side", "side_by_side_at"]


def side_by_side_at(text: str, pos: int) -> bool:
    """Whether position `pos` of `text` lies in numbers side by side (`numbers_side_by_side`: `5 00`, `3 4`) on its
    own line: a line break ends a statement, so `42` and then `7` on the next line is no such run."""
    start, end = text.rfind("\n", 0, pos) + 1, text.find("\n", pos)
    line = text[start : len(text) if end < 0 else end]
    return any(s <= pos - start < e for s, e in numbers_side_by_side(line))
