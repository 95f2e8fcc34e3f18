"""`join_digit_groups`, the math grader's rule for thousands written with spaces: it lives in roll_envs._digit_groups,
shared with `roll_envs.numeric.parse_number` (one rule for rewards and environments); re-exported here."""

from __future__ import annotations

from roll_envs._digit_groups import join_digit_groups

__all__ = ["join_digit_groups"]
