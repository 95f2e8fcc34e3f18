"""roll-eval counts a failed sample as wrong whatever its `correct` says: a row the engine refused (aborted again and
again without a token after it had written part of its answer) holds a cut response the reward may grade right (a
\\boxed{} written before the cut), and a reward failure's grade is not one. Both counted as right in accuracy and
pass@k while `failed` said they were never graded (roll_core.eval_metrics' contract: they count as wrong)."""

from __future__ import annotations

import math
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.eval_metrics import summarize
from roll_core.evaluate import sample_rows
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.protocol import Batch
from roll_core.testing.echo import EchoProblem, EchoTask

ANSWER = 5  # tokens of a complete answer (the reward below grades any complete answer right)
TOKEN = 40  # the token the engine answers with ("E" in the tiny tokenizer)


def _row(index: int, sample: int, correct: float, failed: str | None = None) -> dict[str, Any]:
    return {
        "index": index,
        "problem": f"q{index}",
        "sample": sample,
        "correct": correct,
        "reward": correct,
        "formatted": 1.0,
        "length": 10,
        "finish_reason": "abort" if failed == "engine" else "stop",
        "failed": failed,
    }


def test_failed_samples_count_as_wrong_in_accuracy_and_pass_at_k() -> None:
    """Two problems, two samples each. Problem 0: both right. Problem 1: one right, one refused by the engine whose
    cut response the reward graded right (correct 1.0): a wrong sample. Per problem mean correctness 1 and 0.5:
    accuracy 0.75 +- sqrt(((.25)^2 * 2) / 1 / 2) = 0.25; pass@1 0.75; pass@2 per problem 1 and 1 - C(1,2)/C(2,2) = 1."""
    rows = [_row(0, 0, 1.0), _row(0, 1, 1.0), _row(1, 0, 1.0, failed="engine"), _row(1, 1, 1.0)]
    m = summarize(rows, [1, 2])
    assert m["failed"] == 1
    assert m["accuracy"] == pytest.approx(0.75) and m["pass@1"] == pytest.approx(0.75)
    assert m["accuracy_stderr"] == pytest.approx(0.25) and m["pass@1_stderr"] == pytest.approx(0.25)
    assert m["pass@2"] == pytest.approx(1.0)
    # a reward failure graded right by a reward that also returned NaN for its score: wrong as well
    only = summarize([_row(0, 0, 1.0, failed="reward"), _row(1, 0, 1.0)], [1])
    assert only["accuracy"] == pytest.approx(0.5) and only["accuracy_stderr"] == pytest.approx(math.sqrt(0.25))


class _Engine:
    """Every row: ANSWER tokens, "stop"; row `cut` (of problem 1): the same ANSWER tokens but "abort", and every
    resume of it is aborted without a token, so that it is refused with a complete-looking response."""

    def __init__(self, cut: int) -> None:
        self.cut = cut

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        rows = len(prompts) * n
        resp = torch.full((rows, ANSWER), TOKEN, dtype=torch.long)
        finish = ["abort" if i == self.cut else "stop" for i in range(rows)]
        tensors = {
            "responses": resp,
            "behaviour_logprobs": torch.zeros((rows, ANSWER)),
            "response_mask": torch.ones((rows, ANSWER), dtype=torch.long),
            "truncated": torch.zeros(rows),
        }
        return Batch(tensors, {"finish_reason": finish})

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "abort"))
        return fut


class _Scoring:
    """Right when the response holds a complete answer (as a math reward grades a \\boxed{} wherever it stands);
    row `nan` is graded right but flagged failed (the reward guard's row whose score was NaN keeps its grade)."""

    def __init__(self, tokenizer: Any, nan: int) -> None:
        self.tokenizer, self.nan = tokenizer, nan

    def score(self, batch: Batch) -> Batch:
        mask = batch["response_mask"].bool()
        texts = [self.tokenizer.decode(batch["responses"][i][mask[i]].tolist()) for i in range(len(batch))]
        right = (mask.sum(-1) >= ANSWER).float()
        failed = torch.tensor([i == self.nan for i in range(len(batch))])
        tensors = {"scores": right, "correct": right, "formatted": torch.ones_like(right), "reward_failed": failed}
        out = Batch(tensors, {"response_text": texts})
        out.meta["reward_counters"] = {"rows": len(batch), "failed_rows": 1}
        return out


@pytest.fixture(autouse=True)
def no_idle_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_core import idle_aborts

    monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_S", 0.0)


def test_a_refused_row_is_recorded_wrong_even_when_its_cut_response_grades_right() -> None:
    """samples.jsonl's `correct` of a refused row, and of a row the reward failed on, is 0 (the metrics recomputed
    from it agree with roll-eval's)."""
    tokenizer = build_tiny_tokenizer()
    problems = [EchoProblem(f"p{i}", f"question {i}") for i in range(2)]
    collector = SimpleNamespace(
        cfg=SimpleNamespace(
            model=SimpleNamespace(max_prompt_length=256, chat_template_kwargs={}),
            pipeline=SimpleNamespace(seed=0, max_idle_aborts=3),
        ),
        tokenizer=tokenizer,
        processor=None,
        eval_set=problems,
        infer=_Engine(cut=2),
        sampling=SamplingParams(max_new_tokens=16, temperature=1.0),
        eval_temperature=1.0,
        scoring=_Scoring(tokenizer, nan=3),
    )
    rows, skipped, _ = sample_rows(collector, EchoTask(), 2)
    assert sum(skipped.values()) == 0
    assert [r["failed"] for r in rows] == [None, None, "engine", "reward"]
    assert rows[2]["response"] == "EEEEE" and rows[2]["finish_reason"] == "abort"
    assert [r["correct"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    assert summarize(rows, [1])["accuracy"] == pytest.approx(0.5)
