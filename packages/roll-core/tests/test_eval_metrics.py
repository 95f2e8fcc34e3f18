"""roll_core.eval_metrics: pass@k against hand-worked values and exact enumeration, majority vote's ties and its
answer equivalence (groups, the checks it spends), the summaries and breakdowns of sample records, and the k / n
checks."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from roll_core.eval_metrics import (
    UNKNOWN,
    breakdown,
    difficulty_of,
    majority_vote,
    mean_pass_at_k,
    memoized,
    parse_ks,
    pass_at_k,
    summarize,
    vote_keys,
)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # c/n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (4, 1, 4, 1.0),  # every 4-subset holds the correct one
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (8, 0, 4, 0.0),
        (5, 5, 1, 1.0),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_worked_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample() -> None:
    """Exact enumeration: over every k-subset of n samples of which c are correct."""
    for n in range(1, 9):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                exact = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)


def test_pass_at_k_is_unbiased_over_every_outcome_of_n_samples() -> None:
    """E over all 2^n correctness patterns of n samples (each correct with probability p) of the estimate equals
    the true pass@k, 1 - (1 - p)^k; the naive plug-in 1 - (1 - c/n)^k is biased (checked to differ)."""
    n, p = 6, Fraction(3, 10)
    for k in range(1, n + 1):
        expected_estimate = Fraction(0)
        expected_naive = Fraction(0)
        for pattern in itertools.product((0, 1), repeat=n):
            c = sum(pattern)
            prob = p**c * (1 - p) ** (n - c)
            expected_estimate += prob * Fraction(pass_at_k(n, c, k))
            expected_naive += prob * (1 - (1 - Fraction(c, n)) ** k)
        truth = 1 - (1 - p) ** k
        assert float(expected_estimate) == pytest.approx(float(truth), abs=1e-12), k
        if 1 < k < n:
            assert abs(float(expected_naive - truth)) > 1e-3, k


def test_pass_at_k_is_stable_for_large_n() -> None:
    # C(1000, 100) has 140 digits; the product form stays exact to float precision.
    n, c, k = 1000, 3, 100
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert mean_pass_at_k([(4, 1), (4, 2)], 2) == pytest.approx((0.5 + 5 / 6) / 2)


def test_pass_at_k_refuses_k_above_n_and_bad_counts() -> None:
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="within"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(0, 0, 1)
    with pytest.raises(ValueError, match="of no problems"):
        mean_pass_at_k([], 1)


def test_parse_ks() -> None:
    assert parse_ks("1,4,8", 8) == [1, 4, 8]
    assert parse_ks("4, 1,4", 4) == [1, 4]
    assert parse_ks(None, 8) == [1, 2, 4, 8]
    assert parse_ks(None, 6) == [1, 2, 4, 6]
    assert parse_ks(None, 1) == [1]
    with pytest.raises(ValueError, match=r"1 <= k <= n.*--n 4.*8 is out of range"):
        parse_ks("1,8", 4)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_ks("1;4", 4)


def test_majority_vote_counts_and_breaks_ties_by_first_appearance() -> None:
    assert majority_vote(["3", "5", "5", "3", "5"]) == ("5", 1)
    assert majority_vote(["3", "5", "5", "3"]) == ("3", 0)  # 2-2 tie: "3" appeared first
    assert majority_vote([None, "5", "3", "3", "5"]) == ("5", 1)  # tie: "5" first; None does not vote
    assert majority_vote([None, " 4", "4 ", None]) == ("4", 1)  # whitespace does not split votes
    assert majority_vote([None, None, ""]) == (None, -1)
    assert majority_vote([]) == (None, -1)


def test_majority_vote_index_is_the_first_sample_of_the_winning_group() -> None:
    """With an answer check, the early stop leaves a clearly beaten spelling unplaced; majority_vote then gave the
    first sample of the winner's own spelling (index 1) although sample 0 is the same answer."""
    same = lambda a, b: a.lower() == b.lower()
    assert majority_vote(["A", "a", " a"], same) == ("a", 0)  # "a" x2 leads "A" x1 by more than is left to place
    assert majority_vote(["b", "A", "a", "a"], same) == ("a", 1)
    assert majority_vote(["b", "B", "a"], same) == ("b", 0)  # unchanged where every key was placed


def _rows(spec: list[list[tuple[str | None, int]]], **fields: object) -> list[dict]:
    """Sample records of problems given as [(extracted answer, correct), ...] per problem."""
    out = []
    for i, samples in enumerate(spec):
        for j, (extracted, correct) in enumerate(samples):
            out.append(
                {
                    "index": i,
                    "sample": j,
                    "extracted": extracted,
                    "correct": float(correct),
                    "reward": float(correct) + 0.5,
                    "formatted": float(extracted is not None),
                    "length": 10 * (j + 1),
                    "finish_reason": "length" if j == 0 else "stop",
                    **{k: (v[i] if isinstance(v, list) else v) for k, v in fields.items()},
                }
            )
    return out


def test_summarize_by_hand() -> None:
    rows = _rows(
        [
            [("1", 0), ("2", 1), ("2", 1), ("1", 0)],  # c=2; tie 1-1 vs 2-2 -> one of two right: maj 1/2
            [("5", 1), ("3", 0), ("5", 1), (None, 0)],  # c=2; "5" wins -> right
            [(None, 0), ("9", 0), ("9", 0), ("8", 0)],  # c=0
        ],
        domain=["a", "a", "b"],
    )
    rows.reverse()  # record order does not matter: samples are ordered by their index
    m = summarize(rows, [1, 2, 4])
    assert m["problems"] == 3 and m["samples"] == 12
    assert m["accuracy"] == pytest.approx(4 / 12)
    assert m["pass@1"] == pytest.approx(4 / 12)
    assert m["pass@2"] == pytest.approx((5 / 6 + 5 / 6 + 0) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["maj"] == pytest.approx((0.5 + 1 + 0) / 3) and m["maj_ties"] == 1
    assert m["reward"] == pytest.approx(4 / 12 + 0.5)
    assert m["length_mean"] == pytest.approx(25.0)
    assert m["truncation_rate"] == pytest.approx(0.25)
    assert m["format_rate"] == pytest.approx(10 / 12)
    by = breakdown(rows, "domain", [1, 2])
    assert list(by) == ["b", "a"]  # first-seen order (the records were reversed)
    assert by["a"]["accuracy"] == pytest.approx(0.5) and by["a"]["maj"] == pytest.approx(0.75)
    assert by["b"]["pass@2"] == 0.0 and by["b"]["problems"] == 1
    assert list(breakdown(rows, "difficulty", [1])) == [UNKNOWN]


def test_summarize_without_extracted_answers_and_short_problems() -> None:
    rows = [{k: v for k, v in r.items() if k != "extracted"} for r in _rows([[("1", 1), ("2", 0)]])]
    assert summarize(rows, [1])["maj"] is None
    # A problem that lost a sample (the engine's context): pass@k above its count is not reported.
    rows = _rows([[("1", 1), ("2", 0)], [("1", 1)]])
    m = summarize(rows, [1, 2])
    assert m["pass@1"] == pytest.approx(0.75) and m["pass@2"] is None
    with pytest.raises(ValueError):
        summarize([], [1])


def test_difficulty_of() -> None:
    assert difficulty_of({"difficulty": "hard", "level": 3}) == "hard"
    assert difficulty_of({"level": 3}) == "3"
    assert difficulty_of({"difficulty": " "}) == UNKNOWN
    assert difficulty_of(None) == UNKNOWN


def test_maj_reads_the_grade_of_a_graded_sample_and_failed_samples_are_counted() -> None:
    """Problem 0 votes "5" twice; its first "5" is a row the reward could not score (graded 0 whatever it said), the
    second is graded right: the majority answer is right (maj@n read the first sample's grade: a miss). Failed rows
    still count as wrong in accuracy and pass@k (as eval/accuracy does); `failed` says how many there were."""
    rows = _rows([[("5", 0), ("5", 1), ("3", 0)], [("7", 0), ("7", 0), ("2", 1)]])
    rows[0]["failed"] = "reward"
    rows[3]["failed"] = "reward"  # problem 1's "7": every "7" is wrong or failed -> a miss
    m = summarize(rows, [1, 3])
    assert m["maj"] == pytest.approx(1 / 2)
    assert m["failed"] == 2
    assert m["accuracy"] == pytest.approx(2 / 6) and m["pass@3"] == pytest.approx(1.0)
    assert summarize(_rows([[("1", 1)]]), [1])["failed"] == 0  # records without the field: nothing failed


class _Checker:
    """A task's `same_answer` by hand: answers equal by value (`1/2`, `0.5`, `\\frac{1}{2}`); records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    @staticmethod
    def value(text: str) -> Fraction:
        if text.startswith("\\frac{"):
            num, den = text.removeprefix("\\frac{").removesuffix("}").split("}{")
            return Fraction(int(num), int(den))
        if text == "boom":
            raise ValueError("cannot read boom")
        return Fraction(text)

    def __call__(self, first: str, other: str) -> bool:
        self.calls.append((first, other))
        return self.value(first) == self.value(other)


def test_majority_vote_merges_what_the_task_equates() -> None:
    """3 of 5 responses say 1/2 in three spellings, 2 say 3: by key 3 won (two identical spellings); with the task's
    equivalence the 1/2 group wins, named by its commonest spelling (the earliest on ties), its first sample index
    the group's first. Keys are taken most voted first, each checked against one representative per group."""
    answers = ["3", "0.5", "1/2", " 3", "\\frac{1}{2}"]
    assert majority_vote(answers) == ("3", 0)
    same = _Checker()
    assert vote_keys(answers, same) == ["3", "0.5", "0.5", "3", "0.5"]
    # "0.5" vs 3 (new group); "1/2" vs 3, vs 0.5 (joins); "\\frac" vs 3, vs 0.5 (joins): 5 checks, commoner first.
    assert same.calls == [("3", "0.5"), ("3", "1/2"), ("0.5", "1/2"), ("3", "\\frac{1}{2}"), ("0.5", "\\frac{1}{2}")]
    assert majority_vote(answers, _Checker()) == ("0.5", 1)
    rows = _rows([[(a, int(a.strip() != "3")) for a in answers], [("2", 1), ("4", 0), ("2.0", 1), ("4", 0)]])
    assert summarize(rows, [1])["maj"] == pytest.approx(0.0)  # by key: 3 wins, and 4 (twice) beats 2 and 2.0
    m = summarize(rows, [1], _Checker())
    # 1/2 wins; {2, 2.0} (right) ties {4, 4} (wrong) at two votes: half right, whichever was sampled first.
    assert m["maj"] == pytest.approx(0.75) and m["maj_stderr"] == pytest.approx(0.25) and m["maj_ties"] == 1
    assert breakdown(rows, "domain", [1], _Checker())[UNKNOWN]["maj"] == pytest.approx(0.75)
    # The group's grade comes from its first graded sample, whichever spelling that is.
    graded = _rows([[("0.5", 0), ("3", 0), ("1/2", 1), ("3", 0), ("\\frac{1}{2}", 1)]])
    graded[0]["failed"] = "reward"
    assert summarize(graded, [1], _Checker())["maj"] == pytest.approx(1.0)


def test_majority_vote_checks_only_what_can_change_the_winner_within_a_budget() -> None:
    """A clear majority costs no check; the checks stop once the leader cannot be overtaken; 64 distinct answers
    spend at most `max_checks`, the rest keeping their own vote; a check that raises means "different"."""
    same = _Checker()
    assert majority_vote(["7", "7", "7", "1", "2"], same) == ("7", 0) and same.calls == []
    same = _Checker()  # 4 + 4 + 1 + 1: after 4, 4.0 joins it (8 > 0 + 2 left): 1 and 2 are never checked
    assert vote_keys(["4"] * 4 + ["4.0"] * 4 + ["1", "2"], same) == ["4"] * 8 + ["1", "2"]
    assert same.calls == [("4", "4.0")]
    same = _Checker()
    distinct = [str(i) for i in range(64)]  # no two equal: 2016 checks in full
    assert vote_keys(distinct, same, max_checks=10) == distinct and len(same.calls) == 10  # keys 0..4: 0+1+2+3+4
    assert majority_vote(distinct, _Checker()) == ("0", 0)
    assert vote_keys(["1", "boom", "0.5", "1.0"], _Checker()) == ["1", "boom", "0.5", "1"]  # boom: kept apart
    assert majority_vote([None, None], _Checker()) == (None, -1) and majority_vote(["5"], _Checker()) == ("5", 0)


def test_memoized_checks_each_pair_once() -> None:
    same = _Checker()
    check = memoized(same)
    assert [check("1", "1.0"), check("1", "1.0"), check("1", "2"), check("2", "1")] == [True, True, False, False]
    assert same.calls == [("1", "1.0"), ("1", "2"), ("2", "1")]
