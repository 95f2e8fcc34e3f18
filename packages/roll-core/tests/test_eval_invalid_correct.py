"""roll-eval and a training run's evaluation count a row whose `correct` is no grade the same way.

A scoring without the reward guard in front of it (whose reward gives partial credit, correct=0.5) made roll-eval's
`summarize` refuse the whole evaluation (ValueError), where the training run's eval/accuracy
(roll_core.pipelines.rollout.evaluate) counts such a row as failed in `invalid_correct`: the same rows gave a number
in training and none in roll-eval. Now roll-eval counts it as training does: a failed row (wrong), in `failed` and
`invalid_correct`, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from roll_core.eval_metrics import breakdown, summarize
from roll_core.evaluate import sample_rows
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.rollout import evaluate
from roll_core.protocol import Batch
from roll_core.testing.echo import EchoProblem, EchoTask
from roll_core.testing.evaluation import StopEngine, eval_collector

TOKEN = 40  # the token every response is made of
LIMIT = 64  # model.max_prompt_length


class _Unguarded:
    """Scoring without the reward guard: a row's `correct` is its reference answer read as a number ("0.5":
    partial credit), its score 1."""

    def score(self, batch: Batch) -> Batch:
        correct = [float(a) for a in batch["answer"]]
        n = len(correct)
        tensors = {
            "scores": torch.ones(n),
            "correct": torch.tensor(correct, dtype=torch.float32),
            "formatted": torch.ones(n),
        }
        return Batch(tensors, {"response_text": ["EEE"] * n})


def test_roll_eval_counts_a_correct_that_is_no_grade_as_the_training_evaluation_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Four problems graded 1, 0.5, 0, 1 (domains a, a, b, b): both paths give accuracy 2/4 (the 0.5 row failed,
    wrong), one `invalid_correct`; roll-eval's record of that row says failed "reward", and per domain a: 1/2."""
    tokenizer = build_tiny_tokenizer()
    problems = [
        EchoProblem(f"p{i}", f"question {i}", answer=a, domain=d)
        for i, (a, d) in enumerate([("1", "a"), ("0.5", "a"), ("0", "b"), ("1", "b")])
    ]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    collector = eval_collector(tokenizer, problems, StopEngine(TOKEN), _Unguarded(), params, LIMIT)

    with caplog.at_level(logging.WARNING):
        rows, _, _ = sample_rows(collector, EchoTask(), 1)  # roll-eval's records
        m = summarize(rows, [1])  # refused the rows with a ValueError before
    by = breakdown(rows, "domain", [1])
    res = evaluate(
        StopEngine(TOKEN), _Unguarded(), tokenizer, EchoTask(), problems, max_prompt_length=LIMIT, params=params
    )

    assert m["accuracy"] == pytest.approx(res["accuracy"]) == pytest.approx(0.5)
    assert m["accuracy_stderr"] == pytest.approx(res["accuracy_stderr"])
    assert m["invalid_correct"] == res["invalid_correct"] == 1 and m["failed"] == 1
    assert m["pass@1"] == pytest.approx(0.5)
    assert [r["failed"] for r in rows] == [None, "reward", None, None] and rows[1]["correct"] == 0.0
    assert rows[1]["invalid_correct"] is True
    assert by["a"]["accuracy"] == pytest.approx(res["by_domain"]["a"]["accuracy"]) == pytest.approx(0.5)
    assert by["a"]["invalid_correct"] == 1 and by["b"]["invalid_correct"] == 0
    assert "1 of 4 samples have a correct that is not 0 or 1" in caplog.text


def test_summarize_counts_hand_made_rows_whose_correct_is_no_grade() -> None:
    """Records that never went through roll-eval's sampling (a samples.jsonl written elsewhere): a graded 0.5 and
    NaN are failed samples, never averaged in (accuracy 1/4, not (1 + 0.5) / 4) nor passing pass@k or maj@n."""
    base = {"reward": 1.0, "formatted": 1.0, "length": 1, "finish_reason": "stop", "failed": None, "sample": 0}
    grades = [1.0, 0.5, float("nan"), 0.0]
    rows: list[dict[str, Any]] = [{**base, "index": i, "correct": c, "extracted": "7"} for i, c in enumerate(grades)]
    m = summarize(rows, [1])
    assert m["accuracy"] == pytest.approx(0.25) and m["pass@1"] == pytest.approx(0.25)
    assert m["maj"] == pytest.approx(0.25)  # the 0.5 row's answer is no right answer
    assert m["invalid_correct"] == 2 and m["failed"] == 2
    assert rows[1]["correct"] == 0.5 and rows[1]["failed"] is None  # the caller's rows are not changed
