"""The sweep summary's final held-out accuracy is the job's run summary's: a job whose final evaluation a stop
skipped (a late signal in its last step, or a resume of such a run) has none, and the table showed the last
accuracy its metrics.jsonl logged, an earlier step's model's, as final. No training, no Ray: hand-made job folders
and run_sweep_job with a fake run (roll_core.testing.sweeps)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import roll_core.sweep as sweep
from roll_core.testing.sweeps import multirun_config, reset_sweep_state, run_job, summary_rows


@pytest.fixture(autouse=True)
def _fresh_sweep_state(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_sweep_state(monkeypatch)


def _run(sweep_dir: Path, folder: str, summary: dict[str, Any], metrics: list[dict[str, Any]]) -> Any:
    """A run that logs `metrics` into its job folder and returns `summary`."""

    def run(cfg: Any) -> dict[str, Any]:
        d = sweep_dir / folder
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        return {"stopped_by_signal": None, "late_signal": None, "wall_seconds": 1.0, **summary}

    return run


def test_a_job_whose_final_evaluation_was_skipped_has_no_final_accuracy_in_the_summary(tmp_path: Path) -> None:
    sw = tmp_path / "sweep"
    logged = [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward/mean": 0.5, "eval/accuracy": 0.5},
        {"step": 2, "reward/mean": 0.75},  # its evaluation skipped by a SIGTERM in this last step
    ]
    skipped = {"final_eval_accuracy": None, "skipped": ["final evaluation (step 2)"], "late_signal": 15}
    assert run_job(sw, "0", 0, ["algo.lr=1e-3"], _run(sw, "0", skipped, logged)) is None
    ran = [*logged[:2], {"step": 2, "reward/mean": 0.75, "eval/accuracy": 0.75}]
    assert (
        run_job(sw, "1", 1, ["algo.lr=3e-3"], _run(sw, "1", {"final_eval_accuracy": 0.75, "skipped": []}, ran)) == 0.75
    )

    sweep.SweepSummaryCallback().on_multirun_end(multirun_config(sw))

    skipped_row, ok_row = summary_rows(sw)
    # step 1's 0.5 was shown as the job's final accuracy
    assert (skipped_row["final_eval_accuracy"], skipped_row["best_eval_accuracy"]) == ("", "0.5")
    assert skipped_row["status"] == "ok" and "final evaluation (step 2)" in skipped_row["error"]
    assert (ok_row["final_eval_accuracy"], ok_row["error"]) == ("0.75", "")
    table = (sw / "summary.md").read_text()
    assert "| 0 | algo.lr=1e-3 | ok | 0.75 | 0.75 | - | 0.5 |" in table, table


def test_a_job_without_a_run_summary_keeps_its_last_logged_accuracy(tmp_path: Path) -> None:
    """A failed or killed job returned no summary: its metrics.jsonl is all there is."""
    sw = tmp_path / "sweep"
    d = sw / "0"
    d.mkdir(parents=True)
    (d / sweep.STATUS_FILE).write_text(json.dumps({"job": 0, "overrides": ["algo.lr=1e-3"], "status": "killed"}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval/accuracy": 0.5}) + "\n")
    (row,) = sweep.summarize(sw)
    assert row["final_eval_accuracy"] == 0.5
