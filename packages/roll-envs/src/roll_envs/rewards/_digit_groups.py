"""`join_digit_groups`, `grouped_exponents` and `numbers_side_by_side`, the math grader's rule for thousands written
with spaces and numbers side by side: it lives in roll_envs._digit_groups, shared with
`roll_envs.numeric.parse_number` (one rule for rewards and environments); re-exported here."""

from __future__ import annotations

from roll_envs._digit_groups import grouped_exponents, join_digit_groups, numbers_side_by_side

__all__ = ["grouped_exponents", "join_digit_groups", "numbers_side_by_side"]
