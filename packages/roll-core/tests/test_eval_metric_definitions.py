"""roll-eval's metrics (roll_core.eval_metrics, roll_core.evaluate) against their published definitions, with
references written from the formulas in exact or fp64 arithmetic:

- pass@k: Chen et al. 2021's unbiased estimator `1 - C(n-c, k) / C(n, k)` per problem, averaged over problems
  (k > n refused, stable for large n, pass@1 = c/n = mean accuracy);
- accuracy: each problem's mean correctness averaged over problems, never pooled over samples when problems kept
  different sample counts;
- maj@n: a tie between a right and a wrong answer scores the expected value of a random tie-break (1/2), whatever
  answer was sampled first, and is counted; answers vote under the spelling the reward grades (math: `5`, `5.0`,
  `\\dfrac{10}{2}` one vote; a visual answer is the choice the reward graded); samples without an answer do not vote;
- standard errors: the sample standard deviation (divisor P - 1) of the per-problem scores over sqrt(P).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.eval_metrics import pass_at_k, summarize
from roll_core.evaluate import sample_rows
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.protocol import Batch
from roll_core.testing.echo import EchoProblem


def _ref_pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021, eq. 1 for one problem, exactly: 1 - C(n-c, k) / C(n, k) (C(a, k) = 0 for a < k)."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def _ref_stderr(values: list[float]) -> float:
    """Standard error of the mean over P values in fp64: sqrt(sum (x - mean)^2 / (P - 1)) / sqrt(P)."""
    p = len(values)
    mean = math.fsum(values) / p
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (p - 1)) / math.sqrt(p)


def _rows(problems: list[list[tuple[str | None, int]]]) -> list[dict[str, Any]]:
    """Sample records from per-problem lists of (extracted answer, correct 0/1)."""
    return [
        {
            "index": i,
            "sample": j,
            "extracted": e,
            "correct": float(c),
            "reward": float(c),
            "formatted": 1.0,
            "length": 10,
            "finish_reason": "stop",
            "failed": None,
        }
        for i, samples in enumerate(problems)
        for j, (e, c) in enumerate(samples)
    ]


def test_pass_at_k_matches_the_exact_binomial_form_up_to_large_n() -> None:
    """Every (n, c, k) of a grid up to n = 3000 against the exact ratio of binomials: the product form agrees to
    1e-12 relative where the binomials themselves would overflow a float (C(3000, 1500) ~ 1e901)."""
    for n in (1, 2, 5, 16, 64, 200, 3000):
        for c in sorted({0, 1, n // 3, n // 2, n - 1, n}):
            for k in sorted({1, min(2, n), n // 4 or 1, n // 2 or 1, n}):
                got, ref = pass_at_k(n, c, k), _ref_pass_at_k(n, c, k)
                assert got == pytest.approx(ref, rel=1e-12, abs=1e-15), (n, c, k)
                assert 0.0 <= got <= 1.0
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, rel=1e-15)  # pass@1 is the accuracy
    with pytest.raises(ValueError, match="at least 5 samples"):
        pass_at_k(4, 2, 5)  # n < k: no k responses to draw, refused (not 1.0, not clamped to pass@n)


def test_pass_at_k_is_per_problem_then_averaged_and_pass_at_1_is_accuracy() -> None:
    """600 random problems of 8 samples, records shuffled: pass@k is the mean of the per-problem estimators (never
    C(N-C, k)/C(N, k) of the pooled counts), pass@1 equals the accuracy, and every standard error is the fp64
    reference over problems (divisor P - 1)."""
    rng = random.Random(3)
    problems = [[(str(rng.randint(0, 3)), int(rng.random() < q)) for _ in range(8)] for q in (0.1, 0.5, 0.9) * 200]
    rows = _rows(problems)
    rng.shuffle(rows)
    m = summarize(rows, [1, 2, 4, 8])
    cs = [sum(c for _, c in p) for p in problems]
    for k in (1, 2, 4, 8):
        per = [_ref_pass_at_k(8, c, k) for c in cs]
        assert m[f"pass@{k}"] == pytest.approx(math.fsum(per) / len(per), rel=1e-12)
        assert m[f"pass@{k}_stderr"] == pytest.approx(_ref_stderr(per), rel=1e-9)
    acc = [c / 8 for c in cs]
    assert m["accuracy"] == pytest.approx(m["pass@1"], rel=1e-12) == pytest.approx(math.fsum(cs) / 4800)
    assert m["accuracy_stderr"] == pytest.approx(_ref_stderr(acc), rel=1e-9)
    pooled = _ref_pass_at_k(4800, sum(cs), 2)
    assert abs(m["pass@2"] - pooled) > 0.01  # the pooled number is another one


def test_accuracy_is_not_pooled_over_problems_with_different_sample_counts(caplog: pytest.LogCaptureFixture) -> None:
    """Problem 0 kept 4 samples (all right), problem 1 kept 1 (wrong): the per-problem mean is (1 + 0) / 2 = 0.5,
    as pass@1 and the standard error beside it say; pooling the samples gave 4/5 = 0.8 (the problem with more
    samples weighed 4 times). pass@2 is not reported (problem 1 has no 2 samples), and a warning says why."""
    rows = _rows([[("1", 1)] * 4, [("2", 0)]])
    m = summarize(rows, [1, 2])
    assert m["pass@1"] == pytest.approx(0.5)
    assert m["accuracy"] == pytest.approx(0.5)
    assert m["accuracy_stderr"] == pytest.approx(_ref_stderr([1.0, 0.0]))
    assert m["pass@2"] is None and m["pass@2_stderr"] is None
    assert "1 of 2 problems have fewer than 4 samples" in caplog.text


@pytest.mark.parametrize("order", [("right", "wrong"), ("wrong", "right")])
def test_a_tie_between_a_right_and_a_wrong_answer_scores_one_half_in_either_sample_order(
    order: tuple[str, str],
) -> None:
    """Problem 0: "7" (right) and "3" (wrong) two votes each. The first-sampled answer won the tie: maj@4 was 1 or
    0 by which the engine happened to sample first. A random tie-break's expected score is 1/2 in either order, and
    `maj_ties` counts the problem. Problem 1 has a clear majority (no tie)."""
    right, wrong = ("7", 1), ("3", 0)
    first, second = (right, wrong) if order == ("right", "wrong") else (wrong, right)
    rows = _rows([[first, second, second, first], [("9", 1), ("9", 1), ("8", 0), (None, 0)]])
    m = summarize(rows, [1])
    assert m["maj"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["maj_ties"] == 1
    assert m["maj_stderr"] == pytest.approx(_ref_stderr([0.5, 1.0]))
    # a three-way tie with one right answer: 1/3; a tie between two wrong answers: 0; between two right ones: 1
    three = summarize(_rows([[("1", 0), ("2", 1), ("3", 0)]]), [1])
    assert three["maj"] == pytest.approx(1 / 3) and three["maj_ties"] == 1
    assert summarize(_rows([[("1", 0), ("2", 0)]]), [1])["maj"] == 0.0


def test_samples_without_an_answer_do_not_vote_and_none_at_all_is_wrong() -> None:
    """Three samples without an extractable answer and one right "7": "7" is the majority (no vote for "none").
    A problem where no sample has an answer scores 0."""
    m = summarize(_rows([[(None, 0), (None, 0), (None, 0), ("7", 1)], [(None, 0), (" ", 0)]]), [1])
    assert m["maj"] == pytest.approx(0.5) and m["maj_ties"] == 0


def test_math_answers_vote_under_the_spelling_the_reward_grades() -> None:
    """`\\boxed{5}`, `\\boxed{5.0}`, `\\boxed{\\dfrac{10}{2}}` are one answer to the math reward (each graded right
    against 5): they vote together and outvote two `\\boxed{4}`; a bare `5` has no box, is graded wrong and casts no
    vote (as the reward reads it, it gave no answer)."""
    pytest.importorskip("math_verify")
    from roll_envs.rewards.math import MathReward

    reward = MathReward()
    texts = ["\\boxed{4}", "\\boxed{5}", "\\boxed{4}", "\\boxed{5.0}", "so 5", "\\boxed{\\dfrac{10}{2}}"]
    graded = reward.score(texts, ["5"] * len(texts))
    rows = _rows([[(reward.extract_answer(t), int(c)) for t, c in zip(texts, graded.correct)]])
    assert [r["extracted"] for r in rows] == ["4", "5", "4", "5", None, "5"]
    assert graded.correct == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert summarize(rows, [1])["maj"] == 1.0


def test_a_graded_sample_with_a_correctness_other_than_0_or_1_is_a_failed_sample() -> None:
    """A reward giving correct=0.5 (partial credit) broke pass@1 = accuracy silently (accuracy averaged 0.5, pass@k
    counted it as a pass): it was refused, now it is a failed sample (wrong), counted in `invalid_correct`, as a
    training run's eval/accuracy counts it (test_eval_invalid_correct). A failed sample's value is never read."""
    rows = _rows([[("1", 1), ("2", 0)]])
    rows[1]["correct"] = 0.5
    m = summarize(rows, [1])
    assert m["accuracy"] == m["pass@1"] == pytest.approx(0.5) and m["invalid_correct"] == m["failed"] == 1
    rows[1]["failed"] = "reward"
    assert summarize(rows, [1])["accuracy"] == pytest.approx(0.5) and summarize(rows, [1])["invalid_correct"] == 0


class _TextEngine:
    """Batch `generate`: row i of the n rows per prompt answers `texts[i % len(texts)]`, finished ('stop')."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        ids = [self.tokenizer.encode(self.texts[i % len(self.texts)], add_special_tokens=False) for i in range(n)]
        ids = ids * len(prompts)
        width = max(len(x) for x in ids)
        resp = torch.zeros((len(ids), width), dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):
            resp[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
        fields = {"responses": resp, "behaviour_logprobs": torch.zeros(resp.shape), "response_mask": mask}
        out = Batch({**fields, "truncated": torch.zeros(len(ids))}, {"finish_reason": ["stop"] * len(ids)})
        out.meta["generate_seconds"] = 1.0
        return out


class _RewardScoring:
    """The collector's scoring: `reward.score` of each row's text against its answer, with its metadata."""

    def __init__(self, tokenizer: Any, reward: Any) -> None:
        self.tokenizer, self.reward = tokenizer, reward

    def score(self, batch: Batch) -> Batch:
        mask = batch["response_mask"].bool()
        texts = [self.tokenizer.decode(batch["responses"][i][mask[i]].tolist()) for i in range(len(batch))]
        res = self.reward.score(texts, list(batch["answer"]), metadata=list(batch["metadata"]))
        out = Batch(
            {k: torch.tensor(getattr(res, k)) for k in ("scores", "correct", "formatted")}, {"response_text": texts}
        )
        out.meta["reward_counters"] = {}
        return out


def test_a_visual_vote_is_the_choice_the_reward_graded() -> None:
    """The visual reward grades the last of the row's choices named ("red" in "red, surely"); roll-eval extracted
    without the choices, the last word ("surely"), so three right answers voted for three different words and the
    wrong "blue" x2 won maj@5. With the row's choices the vote is what was graded: "red" 3 to 2."""
    from roll_envs.tasks.visual import VisualReward

    tokenizer = build_tiny_tokenizer()
    texts = ["red, surely", "it is red indeed", "blue", "red I think", "blue"]
    problem = EchoProblem("p0", "which colour? red, blue", answer="red")
    problem.metadata = {"choices": ["red", "blue"]}  # type: ignore[attr-defined]
    task = SimpleNamespace(reward=VisualReward(), messages=lambda p: [{"role": "user", "content": p.prompt}])
    collector = SimpleNamespace(
        cfg=SimpleNamespace(
            model=SimpleNamespace(max_prompt_length=256, chat_template_kwargs={}),
            pipeline=SimpleNamespace(seed=0, max_idle_aborts=3),
        ),
        tokenizer=tokenizer,
        processor=None,
        eval_set=[problem],
        infer=_TextEngine(tokenizer, texts),
        sampling=SamplingParams(max_new_tokens=32, temperature=1.0),
        eval_temperature=1.0,
        scoring=_RewardScoring(tokenizer, VisualReward()),
    )
    rows, _, _ = sample_rows(collector, task, 5)
    assert [r["correct"] for r in rows] == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert [r["extracted"] for r in rows] == ["red", "red", "blue", "red", "blue"]
    assert summarize(rows, [1])["maj"] == 1.0
