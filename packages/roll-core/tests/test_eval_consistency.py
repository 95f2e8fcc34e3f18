"""roll-eval and a training run's held-out evaluation count the same rows the same way, and roll-eval's outputs hold.

- A training run's eval/accuracy (roll_core.pipelines.rollout.evaluate, behind the prompts collector's resuming
  engine) counted a row the engine refused, whose cut response the reward graded right, and a row whose reward was
  NaN (the guard keeps its grade) as right, where roll-eval counts both wrong: the same rows gave two accuracies.
  Its eval/n counted the problems that filled the engine's context (never scored).
- report.md said every skipped problem's prompt was longer than model.max_prompt_length, also those that filled the
  engine's context.
- maj@n: the vote stops once the winner cannot change, and the answers not placed kept their own key, so a graded
  sample equal to the winning answer was missed when grading it ('b' graded right, both 'B' rows failed: 0).
- A plot that raised stopped roll-eval before report.md was written; files are written whole or not at all.
"""

from __future__ import annotations

import logging
import math
import os
import random
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.cluster.reward_guard import GuardedReward
from roll_core.cluster.roles import RewardWorker
from roll_core.eval_compare import EvalTarget, write_outputs
from roll_core.eval_metrics import breakdown, summarize
from roll_core.evaluate import sample_rows
from roll_core.interfaces import Request, RequestOutput, RewardResult, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors.prompts import _Resuming
from roll_core.pipelines.rollout import evaluate
from roll_core.protocol import Batch
from roll_core.report import write_eval_report
from roll_core.testing.echo import EchoProblem, EchoTask
from roll_core.testing.evaluation import eval_collector, sample_records
from roll_core.tracking import replace_file

ANSWER = 5  # tokens of a complete answer: the reward grades a complete answer right, a shorter one wrong
TOKEN = 40  # the token the engine answers with ("E" in the tiny tokenizer)
LIMIT = 64  # model.max_prompt_length


class _Engine:
    """Scripted by problem id: `short` answers 2 tokens (wrong), `cut` a complete answer but "abort", every resume
    of it aborted without a token (refused, its cut response graded right), `ctx` fills the engine's context
    ("prompt_too_long"); every other problem a complete answer ("stop")."""

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        ids = [pid for pid in prompts["problem_id"] for _ in range(n)]
        resp = torch.zeros((len(ids), ANSWER), dtype=torch.long)
        mask = torch.zeros((len(ids), ANSWER), dtype=torch.long)
        finish = []
        for i, pid in enumerate(ids):
            if pid == "ctx":
                finish.append("prompt_too_long")
                continue
            k = 2 if pid == "short" else ANSWER
            resp[i, :k], mask[i, :k] = TOKEN, 1
            finish.append("abort" if pid == "cut" else "stop")
        tensors = {"responses": resp, "behaviour_logprobs": torch.zeros(resp.shape), "response_mask": mask}
        return Batch({**tensors, "truncated": torch.zeros(len(ids))}, {"finish_reason": finish})

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "abort"))
        return fut


class _Reward:
    """Right for a complete answer; the truth "nan" gets a NaN score with its grade (the guard replaces the score,
    flags the row `reward_failed` and keeps `correct`)."""

    def score(self, responses: list[str], answers: list[str]) -> RewardResult:
        right = [float(len(r) >= ANSWER) for r in responses]
        scores = [math.nan if a == "nan" else c for c, a in zip(right, answers)]
        return RewardResult(scores=scores, correct=right, formatted=[1.0] * len(right))


class _Scoring:
    """The reward worker's own scoring (RewardWorker.score) around the real guard, in this process."""

    def __init__(self, tokenizer: Any) -> None:
        self.worker = SimpleNamespace(tokenizer=tokenizer, reward=GuardedReward(_Reward(), isolation="inline"))

    def score(self, batch: Batch) -> Batch:
        return RewardWorker.score(self.worker, batch)


@pytest.fixture(autouse=True)
def no_idle_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_core import idle_aborts

    monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_S", 0.0)


#: Six problems: right, wrong, refused (its cut response grades right), NaN reward (graded right), filling the
#: engine's context, over model.max_prompt_length.
_SIX = [
    EchoProblem("ok", "question 0", domain="a"),
    EchoProblem("short", "question 1", domain="b"),
    EchoProblem("cut", "question 2", domain="a"),
    EchoProblem("nan", "question 3", answer="nan", domain="b"),
    EchoProblem("ctx", "question 4", domain="a"),
    EchoProblem("long", "question " * 200, domain="b"),
]


def test_roll_eval_and_the_training_evaluation_agree_on_the_same_rows() -> None:
    """Six problems: right, wrong, refused (its cut response grades right), NaN reward (graded right), filling the
    engine's context, over model.max_prompt_length. Both paths: accuracy 1/4 (the failed two are wrong), reward
    (1 + 0 + 1 + 0) / 4, four problems scored, per domain the same; roll-eval's skips split by reason."""
    tokenizer = build_tiny_tokenizer()
    problems = _SIX
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    collector = eval_collector(tokenizer, problems, _Engine(), _Scoring(tokenizer), params, LIMIT)
    rows, skipped, _ = sample_rows(collector, EchoTask(), 1)
    assert [r["problem"] for r in rows] == ["ok", "short", "cut", "nan"]
    assert [r["failed"] for r in rows] == [None, None, "engine", "reward"] and rows[2]["response"] == "EEEEE"
    assert skipped == {"prompt_length": 1, "engine_context": 1, "bad_pictures": 0}
    m, by = summarize(rows, [1]), breakdown(rows, "domain", [1])

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    infer = _Resuming(_Engine(), pad, frozenset(), max_idle_aborts=3)  # what the prompts collector evaluates with
    res = evaluate(infer, _Scoring(tokenizer), tokenizer, EchoTask(), problems, max_prompt_length=LIMIT, params=params)

    assert res["accuracy"] == pytest.approx(m["accuracy"]) == pytest.approx(0.25)
    assert res["reward"] == pytest.approx(m["reward"]) == pytest.approx(0.5)
    assert res["n"] == m["problems"] == 4  # eval/n: the problems scored
    assert res["skipped_long"] == 1 and res["skipped_context"] == 1
    assert set(res["by_domain"]) == set(by) == {"a", "b"}
    for d, got in res["by_domain"].items():
        assert got["accuracy"] == pytest.approx(by[d]["accuracy"]) and got["n"] == by[d]["problems"] == 2
    assert res["by_domain"]["a"]["accuracy"] == pytest.approx(0.5)  # right + refused


#: Four problems, two without a domain: right, wrong, right, refused.
_FOUR = [
    EchoProblem("ok", "question 0", domain="a"),
    EchoProblem("short", "question 1"),
    EchoProblem("ok2", "question 2"),
    EchoProblem("cut", "question 3", domain="a"),
]


def _collector(problems: list[EchoProblem]) -> Any:
    """What the prompts collector's `evaluate` (and roll-eval's `sample_rows`) use of a collector."""
    tokenizer = build_tiny_tokenizer()
    return eval_collector(
        tokenizer,
        problems,
        _Engine(),
        _Scoring(tokenizer),
        SamplingParams(max_new_tokens=16, temperature=1.0),
        LIMIT,
        task=EchoTask(),
        reward_model=None,  # reward_model=none (its eval metrics are added when there is one)
        _pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        _cut_ids=frozenset(),
    )


def test_the_training_evaluation_labels_rows_without_a_domain_as_roll_eval_does() -> None:
    """Rows without a domain were `eval/None/...` in a training run and `unknown` in roll-eval (and the docs): the
    same rows under two metric names. Per domain two problems, one right."""
    from roll_core.pipelines.collectors.prompts import PromptCollector

    collector = _collector(_FOUR)
    rows, _, _ = sample_rows(collector, EchoTask(), 1)
    by = breakdown(rows, "domain", [1])
    assert set(by) == {"a", "unknown"}

    out = PromptCollector.evaluate(collector, 0)  # type: ignore[arg-type]

    for d in ("a", "unknown"):
        assert out[f"eval/{d}/accuracy"] == pytest.approx(by[d]["accuracy"]) == pytest.approx(0.5)
        assert out[f"eval/{d}/n"] == by[d]["problems"] == 2
    assert not any(k.startswith("eval/None/") for k in out)


def test_the_training_evaluation_logs_the_accuracy_standard_error_roll_eval_gives() -> None:
    """No eval/accuracy_stderr was logged, so report.md showed no ± for eval/accuracy. accuracy 1/2 over four
    problems: sqrt((4 * 1/4 / 3) / 4) = 0.288675; per domain (two problems, one right): sqrt((2 * 1/4 / 1) / 2) =
    0.5; one problem: none (null, as roll-eval's results)."""
    from roll_core.pipelines.collectors.prompts import PromptCollector

    collector = _collector(_FOUR)
    rows, _, _ = sample_rows(collector, EchoTask(), 1)
    m, by = summarize(rows, [1]), breakdown(rows, "domain", [1])

    out = PromptCollector.evaluate(collector, 0)  # type: ignore[arg-type]

    assert out["eval/accuracy"] == pytest.approx(m["accuracy"]) == pytest.approx(0.5)
    assert out["eval/accuracy_stderr"] == pytest.approx(m["accuracy_stderr"]) == pytest.approx(math.sqrt(1 / 12))
    for d in ("a", "unknown"):
        assert out[f"eval/{d}/accuracy_stderr"] == pytest.approx(by[d]["accuracy_stderr"]) == pytest.approx(0.5)
    assert PromptCollector.evaluate(_collector(_FOUR[:1]), 0)["eval/accuracy_stderr"] is None  # type: ignore[arg-type]


def test_the_training_evaluation_logs_the_held_out_problems_it_skipped() -> None:
    """Of six held-out problems one prompt is over model.max_prompt_length and one fills the engine's context: the
    run logged eval/n 4 and nothing else, as for a held-out set of 4 (report.md's "on 4 held-out problems"), where
    roll-eval lists both skips. They are logged under the training's names, and the evaluation's size counts them."""
    from roll_core.eval_history import last_evaluation_size
    from roll_core.pipelines.collectors.prompts import PromptCollector

    _, skipped, _ = sample_rows(_collector(_SIX), EchoTask(), 1)

    out = PromptCollector.evaluate(_collector(_SIX), 0)  # type: ignore[arg-type]

    assert out["eval/n"] == 4
    assert out["eval/skipped_long_prompts"] == skipped["prompt_length"] == 1
    assert out["eval/skipped_context_prompts"] == skipped["engine_context"] == 1
    assert "eval/skipped_bad_images" not in out  # a text run's evaluation, as its training, has no such key
    assert last_evaluation_size([{"step": 0, **out}]) == len(_SIX)
    none = PromptCollector.evaluate(_collector(_FOUR), 0)  # type: ignore[arg-type]
    assert (none["eval/skipped_long_prompts"], none["eval/skipped_context_prompts"]) == (0, 0)
    assert last_evaluation_size([{"step": 0, **none}]) == len(_FOUR)


def _result(skipped: dict[str, int] | None, total: int) -> dict[str, Any]:
    rows = [
        {
            "index": i,
            "problem": f"q{i}",
            "sample": 0,
            "extracted": "7",
            "correct": 1.0,
            "reward": 1.0,
            "formatted": 1.0,
            "length": 10,
            "finish_reason": "stop",
            "domain": "d",
            "difficulty": "unknown",
            "failed": None,
        }
        for i in range(2)
    ]
    out = {
        "task": "t",
        "metrics": summarize(rows, [1]),
        "by_domain": breakdown(rows, "domain", [1]),
        "by_difficulty": breakdown(rows, "difficulty", [1]),
        "skipped_problems": total,
        "reward_counters": {},
        "rows": rows,
    }
    if skipped is not None:
        out["skipped_by_reason"] = skipped
    return out


def test_report_md_names_each_reason_problems_were_skipped_for(tmp_path: Path) -> None:
    """Model a lost one problem to model.max_prompt_length and two to the engine's context: two lines, not three
    problems 'longer than model.max_prompt_length'; a result without the split says its reason is not recorded."""
    a, b = EvalTarget("a", "a"), EvalTarget("b", "b")
    results = [
        (a, _result({"prompt_length": 1, "engine_context": 2, "bad_pictures": 0}, 3)),
        (b, _result(None, 1)),
    ]
    settings = {"ks": [1], "n": 1}
    files = write_outputs(tmp_path, results, [1], 1, settings)
    text = write_eval_report(tmp_path, results, settings=settings, files=files, argv=["roll-eval"]).read_text()
    assert "- problems skipped (prompt longer than model.max_prompt_length): {'a': 1}" in text
    assert (
        "- problems skipped (prompt fills the inference engine's context, infer_engine.max_model_len): {'a': 2}" in text
    )
    assert "- problems skipped (reason not recorded): {'b': 1}" in text
    assert "pictures" not in text


def test_a_plot_that_raises_leaves_the_files_and_a_complete_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    def broken(self: Axes, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a font cache gone bad")

    monkeypatch.setattr(Axes, "errorbar", broken)
    results = [(EvalTarget("m", "m"), _result({"prompt_length": 0, "engine_context": 0, "bad_pictures": 0}, 0))]
    settings = {"ks": [1], "n": 1}
    with caplog.at_level(logging.WARNING, logger="roll_core.eval_compare"):
        files = write_outputs(tmp_path, results, [1], 1, settings)
    assert "png" not in files and not (tmp_path / "comparison.png").exists()
    assert "comparison.png could not be drawn" in caplog.text and "a font cache gone bad" in caplog.text
    report = write_eval_report(tmp_path, results, settings=settings, files=files, argv=["roll-eval", "m"])
    text = report.read_text(encoding="utf-8")
    assert "## Results" in text and "## Plot" not in text
    assert text.endswith("- [comparison.md](comparison.md)\n")  # the last line: complete
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "comparison.csv",
        "comparison.json",
        "comparison.md",
        "report.md",
        "samples.jsonl",
    ]  # no temporary file left behind


def test_a_write_that_fails_leaves_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "report.md"
    replace_file(path, "old ±\n")
    assert path.read_text(encoding="utf-8") == "old ±\n"

    def died(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", died)
    with pytest.raises(OSError, match="disk full"):
        replace_file(path, "new " * 1000)
    assert path.read_text(encoding="utf-8") == "old ±\n" and [p.name for p in tmp_path.iterdir()] == ["report.md"]


def _brute_force_maj(rows: list[dict[str, Any]], same: Any) -> float:
    """maj@n by its definition: every key placed (most voted first, then earliest; each joins the first group, in
    opening order, whose representative equals it), the most voted group wins, graded by the majority of its graded
    samples' grades (an even split: 1/2; groups tied at the most votes: the mean of their grades)."""
    keys = [(r["extracted"] or "").strip() or None for r in rows]
    first: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k is not None:
            first.setdefault(k, i)
            count[k] = count.get(k, 0) + 1
    if not count:
        return 0.0
    reps: list[str] = []
    group: dict[str, str] = {}
    for k in sorted(count, key=lambda k: (-count[k], first[k])):
        group[k] = next((rep for rep in reps if same(rep, k)), k)
        if group[k] == k:
            reps.append(k)
    votes = {rep: sum(count[k] for k in count if group[k] == rep) for rep in reps}
    most = max(votes.values())
    grades = []
    for winner in (rep for rep in reps if votes[rep] == most):
        graded = [
            r["correct"] > 0 for r, k in zip(rows, keys) if k is not None and not r["failed"] and group[k] == winner
        ]
        right, wrong = sum(graded), len(graded) - sum(graded)
        grades.append(0.0 if not graded else 0.5 if right == wrong else float(right > wrong))
    return sum(grades) / len(grades)


def _case_insensitive(first: str, other: str) -> bool:
    return first.lower() == other.lower()


def _within_one(first: str, other: str) -> bool:  # not transitive: 1 ~ 2 ~ 3, 1 !~ 3
    return abs(int(first) - int(other)) <= 1


def test_majority_vote_grades_the_winner_from_an_equal_answer_the_early_stop_left_unplaced() -> None:
    """'b' (graded right) and two 'B' (the reward failed on both): 'B' leads 2 to the 1 vote left, so 'b' is never
    checked, and the winner's only graded sample was missed (maj 0); by the definition it is right."""
    rows = sample_records([("b", 1.0, None), ("B", 0.0, "reward"), ("B", 0.0, "reward")])
    assert (
        summarize(rows, [1], _case_insensitive)["maj"]
        == pytest.approx(1.0)
        == _brute_force_maj(rows, _case_insensitive)
    )
    # An unplaced answer equal to the winner's and to a group opened before it joins that one (the first it is
    # checked against): '3' opens, '1' opens, '0' joins '1' (6 votes to 3, 1 left: stop); '2' (graded right) equals
    # both '3' and '1' but would join '3': not the winner's, and the winner has no graded sample: wrong.
    failed = [("3", 0.0, "reward")] * 3 + [("1", 0.0, "reward")] * 3 + [("0", 0.0, "reward")] * 3
    rows = sample_records([("2", 1.0, None), *failed])
    assert summarize(rows, [1], _within_one)["maj"] == 0.0 == _brute_force_maj(rows, _within_one)


@pytest.mark.parametrize("same", [_case_insensitive, _within_one])
def test_majority_vote_equals_the_brute_force_definition(same: Any) -> None:
    """600 random problems of 1 to 8 samples (answers, grades, failures at random) within the check budget."""
    rng = random.Random(7)
    alphabet = ["a", "A", "b", "B", "c", " a"] if same is _case_insensitive else ["0", "1", "2", "3", "4"]
    for _ in range(600):
        samples = []
        for _ in range(rng.randint(1, 8)):
            failed = rng.choice([None, None, "reward", "engine"])
            answer = None if failed == "engine" or rng.random() < 0.1 else rng.choice(alphabet)
            samples.append((answer, float(rng.random() < 0.5), failed))
        rows = sample_records(samples)
        assert summarize(rows, [1], same)["maj"] == _brute_force_maj(rows, same), samples
