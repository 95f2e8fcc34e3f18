"""report.md of a resumed run names the evaluations a stop skipped before the resume, as its summary does: a resume
of a complete run whose final evaluation a late signal skipped trains nothing, and its report's status read just
"finished" while the summary said `final_eval_accuracy` None, `skipped` ["final evaluation (step 2)"]."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing import run_pipeline, tiny_overrides


def _sigterm_in_step(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """SIGTERM to this process once step `at` has run (a preemption arriving during the step)."""
    from roll_core.pipelines.loop import Pipeline

    real = Pipeline.step

    def step(self: Pipeline, n: int) -> Any:
        out = real(self, n)
        if n == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Pipeline, "step", step)


def _status(run: Path) -> str:
    lines = (run / "report.md").read_text().splitlines()
    assert lines[2].startswith("- status: "), lines[:4]
    return lines[2].removeprefix("- status: ")


def test_the_report_of_a_resume_that_trains_nothing_names_the_skipped_final_evaluation(
    seven_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    base = [o for o in tiny_overrides(seven_task, run, "pipeline.trackers=[]") if not o.startswith("pipeline.eval")]
    base += ["pipeline.max_steps=2", "pipeline.eval_every=1", "env.eval_size=4"]
    _sigterm_in_step(monkeypatch, 2)
    first, _ = run_pipeline(base)
    assert first["skipped"] == ["final evaluation (step 2)"] and first["late_signal"] == signal.SIGTERM
    monkeypatch.undo()
    again, _ = run_pipeline([*base, "pipeline.resume=true"])
    assert again["late_signal"] is None and again["skipped"] == ["final evaluation (step 2)"]
    ckpt = run / "checkpoints" / "step_000002"
    status = (
        "finished: every step trained and saved (step_000002); a stop before the resume skipped the final "
        f"evaluation (step 2) (roll-eval {ckpt} gives it)"
    )
    assert again["status"] == status and _status(run) == status
