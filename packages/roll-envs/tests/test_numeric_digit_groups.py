"""`roll_envs.numeric.parse_number` (the environments' numbers: agentic.tool_env) reads thousands written with spaces
by the math grader's rule (roll_envs._digit_groups `join_digit_groups`): `5 000` is 5000 wherever the grouping is
certain, and `3 4`, `1234 567`, `5 00`, `1 234,5` are no one number. It read none of them: QAEnv without a reward
marked `\\boxed{5 000}` against 5000 invalid (no number) and compared `5 000` with `5000` as text (wrong), while
MathReward scores it right."""

from __future__ import annotations

from fractions import Fraction

import pytest

from roll_envs._digit_groups import join_digit_groups
from roll_envs.agentic import QAEnv
from roll_envs.agentic.tool_env import _same_answer
from roll_envs.numeric import numbers_equal, parse_number
from roll_envs.rewards.math import MathReward, quantity

GROUPED = [
    ("5 000", Fraction(5000)),
    ("1 234 567", Fraction(1234567)),
    ("-1 234.5", Fraction(-2469, 2)),
    ("5\\,000", Fraction(5000)),
    ("5\u00a0000", Fraction(5000)),
    ("12\u2009345.25", Fraction(49381, 4)),
    (" 5 000 ", Fraction(5000)),
]
NOT_ONE_NUMBER = ["3 4", "1234 567", "5 00", "1 234,5", "10 20 300", "1,000 000", "5  000"]


@pytest.mark.parametrize(("text", "value"), GROUPED)
def test_space_grouped_thousands_are_one_number_as_the_grader_reads_them(text: str, value: Fraction) -> None:
    assert parse_number(text) == value
    assert quantity(text) == (value, False)  # the math grader's value: the same
    assert numbers_equal(text, str(float(value)))


@pytest.mark.parametrize("text", NOT_ONE_NUMBER)
def test_other_runs_of_numbers_apart_by_spaces_are_no_number(text: str) -> None:
    assert join_digit_groups(text) == text  # the grader's rule leaves them as written
    with pytest.raises(ValueError, match="not a plain decimal number"):
        parse_number(text)


@pytest.fixture(scope="module")
def math_reward() -> MathReward:
    return MathReward()


@pytest.mark.parametrize(
    ("answer", "reply", "right"),
    [
        ("5000", "\\boxed{5 000}", True),
        ("5000", "\\boxed{5\\,000}", True),
        ("1234567", "\\boxed{1 234 567}", True),
        ("5 000", "\\boxed{5000}", True),  # a reference written with spaces
        ("5000", "\\boxed{5 001}", False),
        ("34", "\\boxed{3 4}", None),  # no one number: invalid to the env, not 34
    ],
)
def test_qa_env_without_a_reward_agrees_with_the_math_grader(
    math_reward: MathReward, answer: str, reply: str, right: bool | None
) -> None:
    env = QAEnv([("How many?", answer)])
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(reply)
    graded = math_reward.score([reply], [answer]).correct[0]
    if right is None:  # the env's own reading: a numeric answer needs a number
        assert info["invalid_action"] is True and not terminated
        assert graded == 0.0  # the grader does not read 3 4 as 34 either
        return
    assert terminated and info["invalid_action"] is False
    assert reward == float(right) == graded, reply


def test_same_answer_reads_space_grouped_thousands() -> None:
    assert _same_answer("5 000", "5000") and _same_answer("1 234 567", "1,234,567")
    assert not _same_answer("1 234,5", "1234.5") and not _same_answer("3 4", "34")
