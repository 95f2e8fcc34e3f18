"""`last_number` reads a mantissa ending in its dot before an exponent (`3.e5`) as one number, as
`roll_envs.numeric.parse_number` does: it was read as the exponent's digits, 5."""

from roll_envs.numeric import parse_number
from roll_envs.rewards.math import MathReward, last_number


def test_a_mantissa_ending_in_a_dot_keeps_its_exponent() -> None:
    # Returned as stated, as `1.5e3` is, and worth what parse_number reads.
    assert last_number("it is 1.5e3") == "1.5e3"
    assert last_number("it is 3.e5") == "3.e5" and parse_number("3.e5") == 300000
    assert last_number("so x = -3.e-2.") == "-3.e-2" and last_number("about 2.E+3") == "2.E+3"
    assert last_number("it is 1,000.e2") == "1000.e2"
    assert last_number("3.e5 million") == "300000000000"  # a scale word multiplies the whole number


def test_a_trailing_dot_is_still_punctuation() -> None:
    # A dot not followed by an exponent's digits ends the sentence: `3.` is 3, `3.e` and `3.eq` are 3 then words.
    assert last_number("so it is 3.") == "3" and last_number("x = 3.e") == "3" and last_number("3.eq") == "3"


def test_last_number_credit_for_a_dot_exponent() -> None:
    res = MathReward(last_number_weight=0.5).score(["so it is 3.e5", "so it is 3.e5"], ["300000", "5"])
    assert res.scores == [0.5, 0.0]
