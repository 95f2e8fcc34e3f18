"""Math reward (roll_envs.rewards.math): an `n-fold` answer is its multiplier `n`, however it is spelled, and
thousands written with spaces (`5 000`, `1 234 567`, `5\\,000`) are one number wherever a grouping is certain, in
the box, in what reaches math-verify, in `last_number` and in the vote key alike; two numbers side by side are never
merged into one."""

from __future__ import annotations

import pytest

pytest.importorskip("math_verify")

from roll_envs.rewards.math import MathReward, canonical_answer, last_number, quantity


def _correct(pairs: list[tuple[str, str]]) -> list[float]:
    """Correctness of each (boxed answer, truth) pair."""
    res = MathReward().score([f"\\boxed{{{b}}}" for b, _ in pairs], [t for _, t in pairs])
    assert res.counters == {"timeouts": 0, "errors": 0, "no_boxed": 0, "bad_answers": 0}
    return res.correct


def test_an_n_fold_answer_is_its_multiplier_in_every_spelling_and_both_directions() -> None:
    """`5\\text{-fold}` was right against 5 (math-verify drops the text) while `5-fold` was wrong (read as 5 minus
    the letters of fold), `5\\text{ fold}` wrong, and `5\\text{-fold}` wrong against a truth of `5-fold`: one answer
    graded three ways. An n-fold answer is the multiplier n now, either way round, and never another number."""
    spellings = ["5-fold", "5\\text{-fold}", "5\\text{ fold}", "5 fold", "5fold", "5\\mbox{-fold}", "5-fold."]
    assert _correct([(s, "5") for s in spellings]) == [1.0] * len(spellings)
    assert _correct([("5", s) for s in spellings]) == [1.0] * len(spellings)  # gold 5-fold, response 5
    assert _correct([("5\\text{-fold}", "5-fold"), ("5-fold", "5\\text{-fold}"), ("5 fold", "5-fold")]) == [1.0] * 3
    wrong = [
        ("4-fold", "5"),
        ("5-fold", "4"),
        ("4", "5-fold"),
        ("50-fold", "5"),
        ("5-fold", "0.05"),
        ("6-fold", "5\\text{-fold}"),
    ]
    assert _correct(wrong) == [0.0] * len(wrong)
    assert _correct([("5-fold increase", "5"), ("2.5\\text{-fold}", "\\frac{5}{2}")]) == [1.0, 1.0]
    assert quantity("5-fold") == quantity("5\\text{-fold}") == quantity("5")
    assert quantity("5-fold%") is None  # a percent of a multiplier: no one value
    # a number word is not read (as `three` is not 3): never equal to 3, nor to anything but its own text
    assert _correct(
        [("three-fold", "3"), ("3", "three-fold"), ("three-fold", "3-fold"), ("three-fold", "three-fold")]
    ) == [
        0.0,
        0.0,
        0.0,
        1.0,
    ]
    # the vote key and last-number credit read it as the grader does
    r = MathReward()
    assert r.extract_answer("\\boxed{5-fold}") == r.extract_answer("\\boxed{5\\text{-fold}}") == "5"
    assert last_number("a 5-fold increase") == "5" and last_number("a three-fold increase") is None
    res = MathReward(last_number_weight=0.5).score(["It grew 5-fold."], ["5\\text{-fold}"])
    assert res.scores == [0.5]


def test_an_n_fold_inside_a_longer_answer_reaches_math_verify_as_its_number() -> None:
    """In a text that is no quantity, `5-fold` reached math-verify as 5 minus letters and `5\\text{-fold}` as 5:
    `x = 5-fold` was wrong against `x = 5` while `x = 5\\text{-fold}` was right."""
    assert (
        _correct([("x = 5-fold", "x = 5"), ("x = 5\\text{-fold}", "x=5"), ("x = 5\\text{ fold}", "x=5")]) == [1.0] * 3
    )
    assert _correct([("x = 4-fold", "x = 5")]) == [0.0]


def test_space_grouped_thousands_are_one_number_where_the_grouping_is_certain() -> None:
    """`\\boxed{x = 5 000}` was right against a truth of 0 (math-verify read 5 times 000) and wrong against 5000;
    `1234 567` (no thousands grouping: a group of four) was merged into 1234567. Groups of three after a first group
    of one to three digits are one number (plain space, `\\,`, `\\!`, `~`, a no-break or thin space); any other run of
    numbers apart by spaces is left as it is."""
    right = [
        ("5 000", "5000"),
        ("1 234 567", "1234567"),
        ("5\\,000", "5000"),
        ("5\u202f000", "5000"),
        ("-1 234.5", "-1234.5"),
        ("x = 5 000", "x = 5000"),
        ("x=5\\,000", "5000"),
        ("(3 400)", "3400"),
        ("5000", "5 000"),
        ("\\frac{1 000}{3}", "\\frac{1000}{3}"),
        ("(3, 400)", "(3, 400)"),
    ]
    assert _correct(right) == [1.0] * len(right)
    wrong = [
        ("x = 5 000", "0"),
        ("1234 567", "1234567"),  # a first group of four: no grouping
        ("10 20 300", "20310"),  # three numbers side by side, whatever the last two look like (not 10 + 20300)
        ("3 4", "34"),
        ("(3, 4)", "(3400)"),
        ("3 400", "(3, 400)"),
        ("1 234,5", "1234"),  # a decimal comma or a list: no number
        ("1 234,5", "1234.5"),
    ]
    assert _correct(wrong) == [0.0] * len(wrong)
    assert quantity("1234 567") is None and quantity("12 34") is None and quantity("1 2 345") is None
    assert quantity("3.141 592") is None  # digits after a decimal point: not a thousands grouping


def test_last_number_and_the_vote_read_space_grouped_thousands_as_the_grader() -> None:
    """`the answer is 5 000` stated 000 to `last_number`: no credit against 5000, credit against a truth of 0; and
    `1 234 567` stated 567. The vote key is the grader's value."""
    assert last_number("the answer is 5 000") == "5000"
    assert last_number("so 1 234 567 ways") == "1234567"
    assert last_number("it is 5\\,000") == "5000"
    # Numbers side by side are no one number, as in a box (they gave their last group: 567, 4, 100, 300)
    assert last_number("it is 1234\\,567") is None and last_number("values 3 4") is None
    assert last_number("in 2023 100 people") is None  # a first group of four: two numbers
    assert last_number("x = 10 20 300") is None and last_number("the pair (3, 4)") == "4"
    res = MathReward(last_number_weight=0.5).score(
        ["the answer is 5 000", "the answer is 5 000", "so 1 234 567 ways", "so 1 234 567 ways", "(3, 400)"],
        ["5000", "0", "1234567", "567", "400"],
    )
    assert res.scores == [0.5, 0.0, 0.5, 0.0, 0.5]
    r = MathReward()
    assert r.extract_answer("\\boxed{5 000}") == r.extract_answer("\\boxed{5\\,000}") == "5000"
    assert canonical_answer("1234 567") == "1234 567" and canonical_answer("1 234 567") == "1234567"
