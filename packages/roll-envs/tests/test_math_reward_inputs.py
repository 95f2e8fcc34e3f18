"""Math reward inputs math-verify misread: answers over several lines or with a bare `$`, and ground truths it
cannot read at all (roll_envs.rewards.math)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("math_verify")

from roll_envs.rewards.base import RewardResult
from roll_envs.rewards.math import MathReward


def test_an_answer_written_over_several_lines_is_read_whole() -> None:
    """math-verify's `$...$` search stops at a line break: a matrix or tuple boxed over lines scored 0 against the
    same answer on one line (and a truth over lines matched nothing); a wrong one stays wrong."""
    responses = [
        "\\boxed{\\begin{pmatrix} 1 \\\\\n 2 \\end{pmatrix}}",
        "\\boxed{\\begin{pmatrix} 1 \\\\\n 3 \\end{pmatrix}}",
        "\\boxed{(1,\n2)}",
        "\\boxed{x^2\n+1}",
        "\\boxed{x^2+1}",
    ]
    answers = ["\\begin{pmatrix}1\\\\2\\end{pmatrix}"] * 2 + ["(1,2)", "x^2+1", "x^2\n+1"]
    res = MathReward().score(responses, answers)
    assert res.correct == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert res.counters == {"timeouts": 0, "errors": 0, "no_boxed": 0, "bad_answers": 0}


def test_a_bare_dollar_in_the_box_does_not_pick_a_piece_of_it() -> None:
    """A lone `$` inside the box closed the `$...$` math-verify was given, so `7 or $6` was graded as its last
    piece, 6: right against a truth of 6. A lone `$` is a currency sign; pairs still delimit math in text (in the
    box or in the truth)."""
    responses = [
        r"\boxed{7 \text{ or } $6}",
        r"\boxed{5 and $6}",
        r"\boxed{$\frac{1}{2}$}",
        r"\boxed{\text{the answer is } $x+1$}",
        r"\boxed{x+1}",
        r"\boxed{x+2}",
    ]
    answers = ["6", "6", r"\frac12", "x+1", "The answer is $x+1$.", "The answer is $x+1$."]
    res = MathReward().score(responses, answers)
    assert res.correct == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]


def _score_bad_truths() -> RewardResult:
    reward = MathReward(format_weight=0.1)
    # A truth that parses to nothing (`\text{}`, `\ldots`, blank) cannot be matched: the boxed rows are not judged.
    # An unboxed reply is still `no_boxed`; a good truth on the same batch is graded as ever.
    return reward.score(
        [r"\boxed{5}", r"\boxed{x}", r"\boxed{7}", "7", r"\boxed{7}"],
        ["", r"\text{}", r"\ldots", r"\ldots", "7"],
    )


def _check_bad_truths(res: RewardResult) -> None:
    assert res.scores == pytest.approx([0.1, 0.1, 0.1, 0.0, 1.1])
    assert res.correct == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert res.failed == [True, True, True, False, False]
    assert res.counters == {"timeouts": 0, "errors": 0, "no_boxed": 1, "bad_answers": 3}


def test_a_truth_math_verify_cannot_read_is_counted_not_a_wrong_answer() -> None:
    """Such rows scored a silent 0 for every sample (a wrong answer, trained on); now `bad_answers` and `failed`."""
    _check_bad_truths(_score_bad_truths())


def test_a_bad_truth_is_counted_off_the_main_thread_too() -> None:
    """Off the main thread math-verify runs in a forked child: its BadTruthError comes back by name."""
    out: list[RewardResult] = []
    worker = threading.Thread(target=lambda: out.append(_score_bad_truths()))
    worker.start()
    worker.join(timeout=120)
    assert out, "the threaded score did not finish"
    _check_bad_truths(out[0])


def test_majority_vote_equivalence_with_a_bad_key_says_different() -> None:
    """`same_answer` against a first key math-verify cannot read: different, no exception."""
    assert MathReward().same_answer(r"\ldots", r"\ldots") is False
