"""roll-eval's report.md and comparison.png against hand-built results: report.md warns when the models were scored
on different problems (only comparison.md did: report.md's table compared them without a word), and the plot joins
checkpoints in step order whatever order the call named them in (a line drawn 30 -> 10 -> 20 crossed itself and
showed values at steps no checkpoint had)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from roll_core.eval_compare import EvalTarget, write_outputs
from roll_core.eval_metrics import breakdown, summarize
from roll_core.report import write_eval_report


def _rows(correct: dict[int, int]) -> list[dict[str, Any]]:
    """One response per problem `i` with correctness `correct[i]`."""
    return [
        {
            "index": i,
            "problem": f"q{i}",
            "sample": 0,
            "extracted": "7" if c else "3",
            "correct": float(c),
            "reward": float(c),
            "formatted": 1.0,
            "length": 10,
            "finish_reason": "stop",
            "domain": "d",
            "difficulty": "unknown",
            "failed": None,
        }
        for i, c in correct.items()
    ]


def _result(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "task": "t",
        "metrics": summarize(rows, [1]),
        "by_domain": breakdown(rows, "domain", [1]),
        "by_difficulty": breakdown(rows, "difficulty", [1]),
        "skipped_problems": 0,
        "reward_counters": {},
        "rows": rows,
        "accuracy": summarize(rows, [1])["accuracy"],
    }


def test_report_md_warns_that_models_were_scored_on_different_problems(tmp_path: Path) -> None:
    """Model b lost problem q3 (its prompt over model.max_prompt_length in b's tokenizer): a 1.0 against a's 0.75
    is three problems against four, and report.md must say so as comparison.md does."""
    a, b = EvalTarget("a", "a"), EvalTarget("b", "b")
    results = [(a, _result(_rows({0: 1, 1: 1, 2: 1, 3: 0}))), (b, _result(_rows({0: 1, 1: 1, 2: 1})))]
    settings = {"ks": [1], "n": 1}
    files = write_outputs(tmp_path, results, [1], 1, settings)
    report = write_eval_report(tmp_path, results, settings=settings, files=files, argv=["roll-eval", "a", "b"])
    text = report.read_text(encoding="utf-8")
    warning = "**Warning:** b was scored on 3 of the 4 problems the models of this comparison were scored on"
    assert warning in (tmp_path / "comparison.md").read_text(encoding="utf-8")
    assert warning in text and "(missing: q3;" in text
    assert text.index(warning) < text.index("## Results")  # read before the table it qualifies


def test_plot_joins_checkpoints_in_step_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    drawn: list[list[float]] = []
    real = Axes.errorbar

    def recording(self: Axes, x: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        drawn.append([float(v) for v in x])
        return real(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", recording)
    steps = [30, 10, 20]  # as named on the command line
    results = [(EvalTarget(f"step_{s}", f"m{s}", s, run="run"), _result(_rows({0: 1, 1: s // 20}))) for s in steps]
    write_outputs(tmp_path, results, [1], 1, {"ks": [1], "n": 1})
    assert (tmp_path / "comparison.png").is_file()
    # left panel: accuracy and maj@1 against the step, each a line through 10, 20, 30; right panel: one point each
    assert drawn[:2] == [[10.0, 20.0, 30.0], [10.0, 20.0, 30.0]]
