"""Numbers side by side in a box or a ground truth (`5 00`, `3 4`, `10 20 300`: no thousands grouping, which
roll_envs._digit_groups joins, so no one number) reached math-verify, which reads them as a sum or a product of their
numbers (`3 4` is 7, `5 00` is 5*0, `3 1/2` is (3+1)/2): `\\boxed{5 00}` was right against a truth of 0. Such a box
is wrong now and such a truth not judged (`bad_answers`), as a grouping with an exponent (`1 000e5`) already was
(roll_envs._digit_groups `numbers_side_by_side`); valid groupings and ordinary expressions with spaces grade as
before. And `last_number` read the digits of a bare exponent (`1 000 then e5`) as the number 5."""

from __future__ import annotations

import pytest

from roll_envs._digit_groups import numbers_side_by_side
from roll_envs.rewards.math import MathReward, last_number

#: Runs of numbers apart by spacing that are no one number, as the whole text.
SIDE_BY_SIDE = [
    "5 00",
    "3 4",
    "10 20 300",
    "1234 567",
    "2023 100",
    "5\\,00",
    "5~00",
    "5  000",  # two spaces: no grouping
    "3\\quad 4",
    "3\\;4",
    "1 2 3",
    "1 234,5",  # a decimal comma or a list (join_digit_groups leaves it)
    "1 000e5",  # (a grouping with an exponent: `grouped_exponents` too)
]
#: Valid groupings and ordinary expressions with spaces: no such run.
ONE_NUMBER_OR_NONE = [
    "1 000",
    "12 345 678",
    "-1 234.5",
    "5\\,000",
    "2 + 3",
    "x = 5",
    "\\frac{1}{2}",
    "5 \\text{ apples}",
    "3 \\cdot 4",
    "2 \\times 3",
    "\\frac 1 2",  # brace-less arguments: 1/2
    "\\dfrac 3 4",
    "\\sqrt 4 9",
    "x_1 234",  # continues a symbol, as join_digit_groups reads it
    "x^2 3",
    "3.141 592",
    "a_{1 2}",  # an index
    "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
    "(1, 2)",
    "3 \\frac{1}{2}",
    "12 \\text{ and } 15",
]


@pytest.mark.parametrize("text", SIDE_BY_SIDE)
def test_numbers_side_by_side_are_found(text: str) -> None:
    spans = numbers_side_by_side(text)
    assert spans and spans[0][0] == 0
    assert numbers_side_by_side(f"x = {text}") == [(4, 4 + spans[0][1])]  # inside a longer text too


@pytest.mark.parametrize("text", ONE_NUMBER_OR_NONE)
def test_groupings_and_ordinary_expressions_are_no_such_run(text: str) -> None:
    assert numbers_side_by_side(text) == []


@pytest.fixture(scope="module")
def reward() -> MathReward:
    return MathReward()


def test_a_box_of_numbers_side_by_side_is_wrong(reward: MathReward) -> None:
    cases = [  # math-verify's reading of each box is its truth here: all were graded right
        ("5 00", "0"),
        ("x = 5 00", "0"),
        ("5\\,00", "0"),
        ("3 4", "7"),
        ("10 20 300", "330"),
        ("3 1/2", "2"),
        ("(5 00, 1)", "(0, 1)"),
    ]
    res = reward.score([f"\\boxed{{{b}}}" for b, _ in cases], [t for _, t in cases])
    assert res.scores == [0.0] * len(cases) and res.failed == [False] * len(cases)


def test_valid_groupings_and_ordinary_expressions_grade_as_before(reward: MathReward) -> None:
    cases = [
        ("1 000", "1000"),
        ("12 345 678", "12345678"),
        ("2 + 3", "5"),
        ("x = 5", "5"),
        ("\\frac{1}{2}", "0.5"),
        ("5 \\text{ apples}", "5"),
        ("3 \\cdot 4", "12"),
        ("\\frac 1 2", "\\frac{1}{2}"),
        ("\\sqrt 4 9", "18"),
        ("3 \\frac{1}{2}", "\\frac{7}{2}"),
        ("x = 5 000", "5000"),
        ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"),
    ]
    res = reward.score([f"\\boxed{{{b}}}" for b, _ in cases], [t for _, t in cases])
    assert res.scores == [1.0] * len(cases)
    truths = reward.score(["\\boxed{1000}", "\\boxed{5}"], ["1 000", "2 + 3"])  # as truths too
    assert truths.scores == [1.0, 1.0] and truths.counters["bad_answers"] == 0


def test_a_truth_of_numbers_side_by_side_is_not_judged(reward: MathReward) -> None:
    res = reward.score(["\\boxed{0}", "\\boxed{500}", "\\boxed{7}"], ["5 00", "5 00", "3 4"])
    assert res.failed == [True, True, True] and res.counters["bad_answers"] == 3 and res.correct == [0.0] * 3


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("1 000 then e5", "1000"),  # was 5
        ("so e5 it is", None),  # was 5
        ("42 and E-3", "42"),
        ("(e+7)", None),
        ("1.5e3", "1.5e3"),  # an exponent after its mantissa reads as before
        ("2E5 units", "2E5"),
        ("we have 3 e5", "3"),
        ("the answer is 7", "7"),
    ],
)
def test_a_bare_exponent_is_no_last_number(text: str, number: str | None) -> None:
    assert last_number(text) == number
