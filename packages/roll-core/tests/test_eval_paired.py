"""roll-eval's paired differences between models (roll_core.eval_paired): each later model minus the first, per
problem over the problems both were scored on, with the standard error of those differences. A comparison gave
only each model's own `mean ± standard error`, from which the error of a difference cannot be read (the models
are scored on the same problems: their errors are correlated), and problems one model lacked were not paired."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from roll_core.eval_compare import EvalTarget, write_outputs
from roll_core.eval_metrics import breakdown, problem_scores, summarize
from roll_core.eval_paired import paired_differences
from roll_core.report import write_eval_report


def _rows(answers: dict[int, list[str | None]], truth: str = "7") -> list[dict[str, Any]]:
    """Problem i's samples answering `answers[i]` (None: no answer), right when the answer is `truth` (whatever its
    case: `x` and `X` are one answer to this grader)."""
    return [
        {
            "index": i,
            "problem": f"q{i}",
            "sample": j,
            "extracted": a,
            "correct": float(a is not None and a.lower() == truth.lower()),
            "reward": float(a is not None and a.lower() == truth.lower()),
            "formatted": 1.0,
            "length": 10,
            "finish_reason": "stop",
            "domain": "d",
            "difficulty": "unknown",
            "failed": None,
        }
        for i, samples in answers.items()
        for j, a in enumerate(samples)
    ]


def _result(rows: list[dict[str, Any]], ks: list[int]) -> dict[str, Any]:
    m = summarize(rows, ks)
    return {
        "task": "t",
        "metrics": m,
        "by_domain": breakdown(rows, "domain", ks),
        "by_difficulty": breakdown(rows, "difficulty", ks),
        "skipped_problems": 0,
        "reward_counters": {},
        "rows": rows,
        "accuracy": m["accuracy"],
    }


def _pass(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_paired_difference_is_over_the_shared_problems_with_the_error_of_the_differences(tmp_path: Path) -> None:
    """a right on q0, q1 (of q0-q4), b right on q0, q1, q2 and not scored on q4: b - a over q0-q3 is [0, 0, 1, 0],
    +0.25 with a paired error of stdev/sqrt(4) = 0.25 (the two tables' errors combined say 0.38); q4 is counted,
    not scored against a missing answer (b's 3/4 against a's 2/5 read +0.35)."""
    a_rows = _rows({0: ["7"], 1: ["7"], 2: ["3"], 3: ["3"], 4: ["3"]})
    b_rows = _rows({0: ["7"], 1: ["7"], 2: ["7"], 3: ["3"]})
    results = [(EvalTarget("a", "a"), _result(a_rows, [1])), (EvalTarget("b", "b"), _result(b_rows, [1]))]
    settings = {"ks": [1], "n": 1}
    files = write_outputs(tmp_path, results, [1], 1, settings)
    (paired,) = json.loads((tmp_path / "comparison.json").read_text())["paired"]
    diffs = [0.0, 0.0, 1.0, 0.0]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    assert (paired["model"], paired["baseline"]) == ("b", "a")
    assert (paired["problems"], paired["only_model"], paired["only_baseline"]) == (4, 0, 1)
    for name in ("accuracy", "pass@1", "maj"):
        assert paired[name] == pytest.approx(statistics.mean(diffs))
        assert paired[f"{name}_stderr"] == pytest.approx(se)
    unpaired = math.hypot(results[0][1]["metrics"]["accuracy_stderr"], results[1][1]["metrics"]["accuracy_stderr"])
    assert se < unpaired  # what the difference's error is, against what the tables suggested
    shown = f"| b | 4 | {statistics.mean(diffs):+.4f} ± {se:.4f} |"
    assert shown in (tmp_path / "comparison.md").read_text(encoding="utf-8")
    report = write_eval_report(tmp_path, results, settings=settings, files=files, argv=["roll-eval", "a", "b"])
    assert shown in report.read_text(encoding="utf-8")


def test_paired_pass_at_k_and_maj_are_per_problem_differences() -> None:
    """Four samples per problem: pass@2 and maj@4 differences are the means of the per-problem differences of the
    textbook values (math.comb; a 2-2 tie between right and wrong scores 1/2), each later model against the first."""
    base = {0: ["7", "3", "3", "3"], 1: ["7", "7", "3", None], 2: [None, None, None, None]}
    later = {0: ["7", "7", "3", "3"], 1: ["7", "7", "7", "3"], 2: ["7", "3", "3", "5"]}
    last = {0: ["3", "3", "3", "3"], 1: ["7", "7", "7", "7"], 2: ["7", "7", "7", "3"]}
    ks = [1, 2, 4]
    results = [(EvalTarget(t, t), _result(_rows(a), ks)) for t, a in (("base", base), ("later", later), ("last", last))]
    records = paired_differences(results, ks)
    assert [(r["model"], r["baseline"]) for r in records] == [("later", "base"), ("last", "base")]

    def expected(answers: dict[int, list[str | None]]) -> dict[int, dict[str, float]]:
        out = {}
        for i, s in answers.items():
            c = s.count("7")
            votes = {a: s.count(a) for a in s if a is not None}
            top = max(votes.values(), default=0)
            tied = [a for a in votes if votes[a] == top]
            out[i] = {f"pass@{k}": _pass(len(s), c, k) for k in ks}
            out[i]["maj"] = sum(a == "7" for a in tied) / len(tied) if tied else 0.0
        return out

    b = expected(base)
    for record, answers in zip(records, (later, last)):
        mine = expected(answers)
        for name in ("pass@2", "pass@4", "maj"):
            diffs = [mine[i][name] - b[i][name] for i in b]
            assert record[name] == pytest.approx(statistics.mean(diffs)), (record["model"], name)
            assert record[f"{name}_stderr"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(3))


def test_problem_scores_average_to_summarize_and_keep_the_tasks_answer_equivalence() -> None:
    """`problem_scores` are the values `summarize` averages, maj@n with the task's `same_answer`, which a model's
    result carries (`per_problem`) so that its paired maj@n is the one its table shows."""
    same = lambda a, b: a.lower() == b.lower()  # "x" and "X": one answer to this grader
    rows = _rows({0: ["x", "X", "y"], 1: ["y", "x", "y"], 2: [None, "x", "y"]}, truth="x")
    ks = [1, 3]
    m, scores = summarize(rows, ks, same), problem_scores(rows, ks, same)
    for name in ("accuracy", "pass@1", "pass@3", "maj"):
        assert statistics.mean(s[name] for s in scores.values()) == pytest.approx(m[name]), name
    assert scores[0]["maj"] == 1.0  # "x" + "X" outvote "y"
    assert problem_scores(rows, ks)[0]["maj"] == pytest.approx(2 / 3)  # by key alone: a three-way tie, 2 right
    wrong = _rows({0: ["y", "y", "y"], 1: ["y", "y", "y"], 2: ["y", "y", "y"]}, truth="x")
    results = [(EvalTarget("w", "w"), _result(wrong, ks)), (EvalTarget("r", "r"), {**_result(rows, ks)})]
    results[1][1]["per_problem"] = scores
    (paired,) = paired_differences(results, ks)
    assert paired["maj"] == pytest.approx(m["maj"])  # the first model's maj@3 is 0 on every problem


def test_a_metric_one_side_lacks_is_no_difference_and_one_model_has_no_pairs(tmp_path: Path) -> None:
    """b kept 2 samples of q1 (pass@3 is not defined there), a has no extracted answers (no maj@n): those
    differences are None, never computed over a subset; one model writes no paired section."""
    a_rows = [{k: v for k, v in r.items() if k != "extracted"} for r in _rows({0: ["7"] * 3, 1: ["3"] * 3})]
    b_rows = _rows({0: ["7", "3", "3"], 1: ["7", "3"]})
    results = [(EvalTarget("a", "a"), _result(a_rows, [1])), (EvalTarget("b", "b"), _result(b_rows, [1]))]
    (paired,) = paired_differences(results, [1, 3])
    assert paired["pass@3"] is None and paired["maj"] is None
    assert paired["accuracy"] == pytest.approx(statistics.mean([1 / 3 - 1, 1 / 2 - 0]))
    write_outputs(tmp_path, results[:1], [1], 1, {"ks": [1], "n": 1})
    assert json.loads((tmp_path / "comparison.json").read_text())["paired"] == []
    assert "Paired differences" not in (tmp_path / "comparison.md").read_text(encoding="utf-8")
