"""The score rules of roll_envs.rewards._judge_parse: a judge reply naming several different scores is an invalid
verdict (`judge_invalid`), never its last score (`Score: 8 (a score: 3 would be for ...)` was read as 3), unless its
last line is only a score (the form the templates ask for), which then counts; well-formed replies read as before."""

from __future__ import annotations

import pytest

from roll_envs.rewards._judge_parse import ScoreParser
from roll_envs.rewards._judge_spec import JudgeSpec

P = ScoreParser(0, 10)


@pytest.mark.parametrize(
    "reply",
    [
        "Score: 8 (a score: 3 would be for a wrong unit)",
        "Score: 8\nA Score 3 would be for a wrong unit.",
        "Score: 3 at first; on reflection, Score: 8",
        "Rating: [[8]]. Had it no units: [[3]] and an explanation.",
        "Score: 8/10, though a strict grader gives Score: 4/5",
        "Score: 11, no, Score: 10",  # one invalid reading among the scores: no agreement
    ],
)
def test_different_scores_without_a_final_score_line_are_an_invalid_verdict(reply: str) -> None:
    assert P(reply) is None, reply


def test_a_final_score_line_wins_and_agreeing_scores_read_as_one() -> None:
    assert P("Score: 3 at first.\nOn reflection, it is right.\nScore: 8") == pytest.approx(0.8)
    assert P("A score: 3 would mean a wrong unit.\n\n**Final Score**: 8/10.\n") == pytest.approx(0.8)
    assert P("Without units: [[3]].\nRating: [[9]]") == pytest.approx(0.9)
    assert P("Score: 8\n- Score: 11") is None  # the final line counts, also when it is no valid score
    assert P("Score: 8. I repeat: Score: 8.0") == pytest.approx(0.8)  # the same score twice is one score
    assert P("Score: 7\n(The reference is 3 and the response says 3.)") == pytest.approx(0.7)  # numbers, not scores
    # your own pattern follows the same rules
    own = ScoreParser(0, 10, r"(\d+)\s*/\s*10")
    assert own("3/10 at first, then 8/10 with the units") is None and own("first 3/10\n8 / 10") == 0.8


def test_the_judge_reward_counts_a_reply_with_different_scores_as_invalid() -> None:
    """Through the built-in correctness template's parser (what JudgeReward.score applies to each reply)."""
    spec = JudgeSpec.resolve("correctness", None, None, None, None, None, None)
    assert spec.parser("The response is right.\nScore: 9") == pytest.approx(0.9)
    assert spec.parser("Score: 9 (a score: 2 would be for no answer)") is None
