"""The summary of a resumed run says what the run as a whole skipped: the evaluations a stop skipped are
checkpointed (`skipped_evals` in state.json), so a resume of a complete run whose final evaluation a late signal
skipped reports no `final_eval_accuracy` (an earlier step's accuracy passed for the final model's: roll-train's
return value, which Hydra sweepers optimise, and a resumed sweep's job summary) and names the skipped evaluation."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from roll_core.testing import run_pipeline


def test_a_resume_of_a_run_whose_final_evaluation_was_skipped_reports_no_final_accuracy(
    stopped_run: Callable[[int, int], tuple[Path, list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, base = stopped_run(2, stop_in=2)
    first, history = run_pipeline(base)
    assert first["final_eval_accuracy"] is None and first["skipped"] == ["final evaluation (step 2)"]
    assert [h["step"] for h in history if "eval/accuracy" in h] == [0, 1]
    monkeypatch.undo()
    again, resumed = run_pipeline([*base, "pipeline.resume=true"])
    assert resumed == history  # nothing trained, nothing logged
    # It was step 1's accuracy, the model of step 1's, and `skipped` was empty.
    assert again["final_eval_accuracy"] is None and again["skipped"] == ["final evaluation (step 2)"]
    assert again["best_eval_accuracy"] == first["best_eval_accuracy"] is not None
    assert again["stopped_by_signal"] is None and again["late_signal"] is None
    state = json.loads((run / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["skipped_evals"] == [2]


def test_an_evaluation_a_stop_skipped_is_still_named_after_the_resumed_run_finishes(
    stopped_run: Callable[[int, int], tuple[Path, list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, base = stopped_run(3, stop_in=2)
    first, _ = run_pipeline(base)
    assert first["stopped_by_signal"] == signal.SIGTERM and first["skipped"] == ["evaluation (step 2)"]
    monkeypatch.undo()
    again, history = run_pipeline([*base, "pipeline.resume=true"])
    assert [h["step"] for h in history if "eval/accuracy" in h] == [0, 1, 3]
    # the final evaluation ran (step 3's model): its accuracy is the final one; step 2's skip is the run's
    assert again["final_eval_accuracy"] == history[-1]["eval/accuracy"] and again["skipped"] == ["evaluation (step 2)"]
    state = json.loads((run / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["skipped_evals"] == [2]
