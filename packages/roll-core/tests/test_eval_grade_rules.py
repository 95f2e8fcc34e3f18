"""Two rules of the held-out metrics about what a sample's `correct` can say.

- A training run's eval/accuracy (roll_core.pipelines.rollout.evaluate) averaged the rows' float `correct`: a reward
  returning partial credit (correct=0.5) or NaN raised (or NaN-ed) it silently, where roll-eval's `summarize` refuses
  such a row and roll's reward guard flags it failed (its `correct` 0). Now it is a failed row, counted in
  `invalid_correct`: the accuracy is the one the guard would have given.
- maj@n graded the winning answer by its first graded sample, so samples of one answer graded differently (a
  math-verify timeout grading one copy of the right answer wrong) made maj@n 1 or 0 by sampling order. Now the
  group's graded samples vote (an even split: 1/2, as a tie between answers scores), counted in `maj_split_grades`.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.cluster.reward_guard import GuardedReward
from roll_core.cluster.roles import RewardWorker
from roll_core.eval_metrics import is_grade, summarize
from roll_core.interfaces import RewardResult, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.rollout import evaluate
from roll_core.protocol import Batch
from roll_core.testing.echo import EchoProblem, EchoTask
from roll_core.testing.evaluation import StopEngine, sample_records

TOKEN = 40  # the token every response is made of


class _AnswerIsTheGrade:
    """A reward whose `correct` for a row is its reference answer read as a number ("0.5": partial credit)."""

    def score(self, responses: list[str], answers: list[str]) -> RewardResult:
        n = len(responses)
        return RewardResult(scores=[1.0] * n, correct=[float(a) for a in answers], formatted=[1.0] * n)


class _Unguarded:
    """Scoring that hands the reward's result on as it is (no reward guard in front of it)."""

    def score(self, batch: Batch) -> Batch:
        res = _AnswerIsTheGrade().score([""] * len(batch), list(batch["answer"]))
        fields = {k: torch.tensor(getattr(res, k), dtype=torch.float32) for k in ("scores", "correct", "formatted")}
        return Batch(fields, {})


class _Guarded:
    """The reward worker's scoring (RewardWorker.score) around the real guard, in this process."""

    def __init__(self, tokenizer: Any) -> None:
        self.worker = SimpleNamespace(
            tokenizer=tokenizer, reward=GuardedReward(_AnswerIsTheGrade(), isolation="inline")
        )

    def score(self, batch: Batch) -> Batch:
        return RewardWorker.score(self.worker, batch)


def test_a_correct_that_is_no_grade_is_a_failed_row_in_the_training_evaluation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Five problems graded 1, 0, 0.5, 1, NaN: the old eval/accuracy was (1 + 0 + 0.5 + 1 + NaN) / 5 = NaN (without
    the NaN row (1 + 0 + 0.5 + 1) / 4 = 0.625, inflated by the half point). Now 0.5 and NaN are failed rows: 2/5,
    with 2 counted in `invalid_correct`, the same accuracy and standard error the reward guard's scoring gives."""
    tokenizer = build_tiny_tokenizer()
    problems = [EchoProblem(f"p{i}", f"question {i}", answer=a) for i, a in enumerate(["1", "0", "0.5", "1", "nan"])]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    kwargs: dict[str, Any] = {"max_prompt_length": 64, "params": params}

    res = evaluate(StopEngine(TOKEN), _Unguarded(), tokenizer, EchoTask(), problems, **kwargs)
    guarded = evaluate(StopEngine(TOKEN), _Guarded(tokenizer), tokenizer, EchoTask(), problems, **kwargs)

    assert res["accuracy"] == pytest.approx(0.4) and res["invalid_correct"] == 2
    assert res["accuracy_stderr"] == pytest.approx((0.4 * 0.6 / 4) ** 0.5)  # sqrt(p (1 - p) / (n - 1))
    assert "2 of 5 rows have a correct that is not 0 or 1" in caplog.text
    assert guarded["accuracy"] == pytest.approx(res["accuracy"]) and guarded["invalid_correct"] == 0
    assert guarded["accuracy_stderr"] == pytest.approx(res["accuracy_stderr"])
    # 0/1 grades (bools included) pass; a fraction, NaN, None or text does not
    assert [is_grade(v) for v in (0, 1, 0.0, 1.0, True, False)] == [True] * 6
    assert [is_grade(v) for v in (0.5, float("nan"), None, "1", 2)] == [False] * 5


def _rows(samples: list[tuple[str, float]], failed: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """One problem's sample records from (extracted answer, correct); `failed`: sample index -> its `failed`."""
    return sample_records([(e, c, (failed or {}).get(j)) for j, (e, c) in enumerate(samples)])


@pytest.mark.parametrize(
    ("grades", "maj"),
    [
        ([0.0, 1.0, 1.0], 1.0),  # the first copy timed out (graded wrong): two of three right, right (was 0)
        ([1.0, 0.0, 0.0], 0.0),  # one of three right: wrong (was 1)
        ([1.0, 0.0], 0.5),  # an even split: half right, in either order (was 1)
        ([0.0, 1.0], 0.5),  # (was 0)
    ],
)
def test_an_answer_is_graded_by_the_majority_of_its_samples_grades(grades: list[float], maj: float) -> None:
    """Every sample answers "7"; their grades disagree. A lone wrong "3" loses the vote in each case."""
    rows = _rows([("7", g) for g in grades] + [("3", 0.0)])
    m = summarize(rows, [1])
    assert m["maj"] == pytest.approx(maj) and m["maj_ties"] == 0
    assert m["maj_split_grades"] == 1


def test_failed_samples_give_no_grade_and_agreeing_grades_split_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """A failed sample of the winning answer never grades it (its 0 is no verdict): "7" graded 0 (failed), 1, 0
    (failed), 1 is right with no split; with one graded wrong copy beside two right ones it is still right, and the
    split is counted and logged."""
    caplog.set_level(logging.WARNING, logger="roll_core.eval_metrics")
    rows = _rows([("7", 0.0), ("7", 1.0), ("7", 0.0), ("7", 1.0)], failed={0: "reward", 2: "reward"})
    m = summarize(rows, [1])
    assert m["maj"] == 1.0 and m["maj_split_grades"] == 0
    assert "graded both right and wrong" not in caplog.text
    split = summarize(_rows([("7", 1.0), ("7", 0.0), ("7", 1.0)]), [1])
    assert split["maj"] == 1.0 and split["maj_split_grades"] == 1
    assert "in 1 of 1 problems the samples giving a scored answer were graded both right and wrong" in caplog.text
