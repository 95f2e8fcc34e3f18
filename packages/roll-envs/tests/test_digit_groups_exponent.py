"""A thousands grouping written with spaces and followed by a decimal exponent (`1 000e5`) was joined into `1000e5`
and read as 1e8, where `1,000e5` (a comma grouping with an exponent) is no number to roll_envs.numeric. It is no
one number now, as `1,000e5` is (roll_envs._digit_groups): left as written, no plain number, no quantity; the math
grader grades a box holding one wrong (math-verify would read its last group, `000e5`: 0), does not judge a ground
truth holding one (`bad_answers`) and takes no last number from it."""

from __future__ import annotations

import pytest

from roll_envs import _digit_groups as dg
from roll_envs._digit_groups import join_digit_groups
from roll_envs.numeric import parse_number
from roll_envs.rewards.math import MathReward, last_number, quantity

GROUPED_WITH_EXPONENT = ["1 000e5", "1 000E5", "1 000e-5", "5 000.5e2", "1\u2009234E+3", "5\\,000e2"]


@pytest.mark.parametrize("text", GROUPED_WITH_EXPONENT)
def test_a_digit_grouping_with_an_exponent_is_no_number(text: str) -> None:
    assert join_digit_groups(text) == text and dg.grouped_exponents(text) == [(0, len(text))]
    with pytest.raises(ValueError, match="not a plain decimal number"):
        parse_number(text)
    with pytest.raises(ValueError, match="not a plain decimal number"):
        parse_number(text.replace(" ", ",").replace("\u2009", ",").replace("\\,", ","))  # as `1,000e5` is
    assert quantity(text) is None
    assert last_number(f"so the answer is {text}") is None


def test_groupings_without_an_exponent_and_exponents_without_grouping_read_as_before() -> None:
    assert parse_number("1 000") == 1000 and parse_number("1000e5") == 10**8 and parse_number("1 000.5") == 1000.5
    assert join_digit_groups("5 000 euros") == "5000 euros" and dg.grouped_exponents("5 000 euros") == []
    assert dg.grouped_exponents("3 4e5") == []  # no grouping: numbers side by side, as before
    assert last_number("the answer is 1 000") == "1000"


def test_the_math_grader_grades_a_grouping_with_an_exponent_as_no_answer() -> None:
    reward = MathReward(last_number_weight=0.5)
    cases = [
        ("\\boxed{1 000e5}", "0", 0.0),  # math-verify read its last group 000e5: right against 0
        ("\\boxed{1 000e5}", "100000000", 0.0),
        ("The answer is 1 000e5", "0", 0.0),  # no last number (was 1000e5)
        ("The answer is 1 000e5", "100000000", 0.0),
        ("\\boxed{1000e5}", "100000000", 1.0),  # an exponent alone reads
        ("\\boxed{5 000}", "5000", 1.0),  # a grouping alone reads
    ]
    res = reward.score([r for r, _, _ in cases], [t for _, t, _ in cases])
    assert res.scores == [s for _, _, s in cases]
    truth = reward.score(["\\boxed{100000000}", "\\boxed{0}"], ["1 000e5", "1 000e5"])
    assert truth.failed == [True, True] and truth.counters["bad_answers"] == 2 and truth.correct == [0.0, 0.0]
