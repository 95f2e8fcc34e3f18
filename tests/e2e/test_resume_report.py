"""report.md of a resumed run names the evaluations a stop skipped before the resume, as its summary does: a resume
of a complete run whose final evaluation a late signal skipped trains nothing, and its report's status read just
"finished" while the summary said `final_eval_accuracy` None, `skipped` ["final evaluation (step 2)"]."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from roll_core.testing import run_pipeline


def _status(run: Path) -> str:
    lines = (run / "report.md").read_text().splitlines()
    assert lines[2].startswith("- status: "), lines[:4]
    return lines[2].removeprefix("- status: ")


def test_the_report_of_a_resume_that_trains_nothing_names_the_skipped_final_evaluation(
    stopped_run: Callable[[int, int], tuple[Path, list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, base = stopped_run(2, stop_in=2)
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
