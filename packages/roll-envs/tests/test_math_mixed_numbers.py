"""Answer reading in the math reward, three gaps:

- `\\boxed{3.e5}` (a mantissa ending in its dot before an exponent) was no quantity, so it was graded wrong against
  300000 while `last_number` already read a stated `3.e5` as 300000.
- `last_number` read numbers side by side (`5 00`, `3 4`, `10 20 300`) as their last group (`00`, `4`, `300`),
  where a box holding them is refused: now None, as no one number is stated (a line break ends a statement).
- Mixed numbers (roll_envs.rewards._mixed): `3 1/2` was refused as numbers side by side (a truth not judged), and
  `3\\frac{1}{2} cups` / `3\\frac{1}{2}\\%` were graded wrong against 3.5, while math-verify already read a bare
  `3\\frac{1}{2}` as 7/2; `last_number` read `3\\frac{1}{2}` as 3 and `3\\tfrac12` as 12. A whole number followed by a
  fraction is now their sum everywhere, as MATH's answers mean it (`2\\frac{1}{2}` is 2.5).
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from roll_envs.rewards._mixed import plain_as_latex
from roll_envs.rewards.math import MathReward, canonical_answer, last_number, quantity


@pytest.fixture(scope="module")
def reward() -> MathReward:
    return MathReward(last_number_weight=0.5)


def _boxed(reward: MathReward, cases: list[tuple[str, str]]) -> list[float]:
    res = reward.score([f"\\boxed{{{b}}}" for b, _ in cases], [t for _, t in cases])
    assert res.counters["bad_answers"] == 0 and res.failed == [False] * len(cases)
    return res.scores


def test_a_boxed_dot_exponent_is_its_number(reward: MathReward) -> None:
    assert quantity("3.e5") == (300000, False) and quantity("-2.E-1") == (Fraction(-1, 5), False)
    assert canonical_answer("3.e5") == "300000"
    cases = [("3.e5", "300000"), ("3.e5", "3 \\times 10^5"), ("3.E+5", "300000"), ("3.e5", "5"), ("3.e5", "3")]
    assert _boxed(reward, cases) == [1.0, 1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("the answer is 5 00", None),  # was 00 (a truth of 0 earned the last-number credit)
        ("it is 3 4.", None),  # was 4
        ("x = 10 20 300", None),  # was 300
        ("about 5  000", None),  # two spaces: no grouping; was 000
        ("so 5\\,00", None),
        ("the answer is 5 000", "5000"),  # a thousands grouping: one number, as before
        ("we get 42\n7", "7"),  # a line break ends a statement: no run
        ("3 apples and 4 pears", "4"),
    ],
)
def test_last_number_refuses_numbers_side_by_side(text: str, number: str | None) -> None:
    assert last_number(text) == number


def test_no_last_number_credit_for_numbers_side_by_side(reward: MathReward) -> None:
    res = reward.score(["the answer is 5 00", "the answer is 5 00", "the answer is 5 000"], ["0", "500", "5000"])
    assert res.scores == [0.0, 0.0, 0.5]


def test_plain_mixed_numbers_are_written_in_latex() -> None:
    assert plain_as_latex("3 1/2") == "3\\frac{1}{2}"
    assert plain_as_latex("x = -12 3/4 cups") == "x = -12\\frac{3}{4} cups"
    for text in ["3 7/2", "x_3 1/2", "0.3 1/2", "1/3 1/2", "10 3 1/2", "3 1/2x", "3 1/2^2", "3 1/2.5", "3\n1/2"]:
        assert plain_as_latex(text) == text, text


def test_mixed_numbers_are_their_sum(reward: MathReward) -> None:
    for text in ["3 1/2", "3\\frac{1}{2}", "3\\tfrac12", "3 \\dfrac{1}{2}", "\\$3\\frac{1}{2}", "3\\frac{1}{2} cups"]:
        assert quantity(text) == (3.5, False), text
        assert canonical_answer(text) == "3.5", text  # one vote key with 3.5 and 7/2
    assert quantity("-3 1/2") == (-3.5, False) and quantity("3\\frac{1}{2}\\%") == (3.5, True)
    assert quantity("3\\frac{7}{2}") == (6.5, False)  # math-verify's reading of any positive fraction after digits
    right = [
        ("3 1/2", "3.5"),
        ("3 1/2", "\\frac{7}{2}"),
        ("3\\frac{1}{2}", "3.5"),
        ("3\\tfrac12", "\\frac{7}{2}"),
        ("3.5", "3\\frac{1}{2}"),
        ("7/2", "3 1/2"),  # a truth of `3 1/2` was not judged
        ("-3 1/2", "-3.5"),
        ("3\\frac{1}{2} cups", "3.5"),
        ("3\\frac{1}{2}\\%", "3.5\\%"),
        ("x = 3 1/2", "3.5"),  # not a quantity: math-verify reads the LaTeX spelling
    ]
    assert _boxed(reward, right) == [1.0] * len(right)
    wrong = [("3 1/2", "2"), ("3 1/2", "1.5"), ("3\\frac{1}{2}", "3"), ("3 1/2", "3")]
    assert _boxed(reward, wrong) == [0.0] * len(wrong)


def test_an_improper_plain_mixed_number_stays_refused(reward: MathReward) -> None:
    res = reward.score(["\\boxed{3 7/2}", "\\boxed{6.5}"], ["6.5", "3 7/2"])
    assert res.scores == [0.0, 0.0] and res.failed == [False, True]


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("the answer is 3\\frac{1}{2}", "3.5"),  # was 3
        ("the answer is 3\\tfrac12", "3.5"),  # was 12
        ("it takes 3 1/2 cups", "3.5"),  # was 3
        ("x = -3\\frac{1}{2}", "-3.5"),
        ("so 3\\frac12 million", "3500000"),
        ("half is \\frac12", None),  # was 12
        ("it is 2\\frac{x}{2}", "2"),  # letters: no mixed number
    ],
)
def test_last_number_reads_mixed_numbers(text: str, number: str | None) -> None:
    assert last_number(text) == number


def test_last_number_credit_for_a_mixed_number(reward: MathReward) -> None:
    res = reward.score(["so 3\\frac{1}{2}", "so 3\\frac{1}{2}", "so 3 1/2"], ["3.5", "3", "\\frac{7}{2}"])
    assert res.scores == [0.5, 0.0, 0.5]
