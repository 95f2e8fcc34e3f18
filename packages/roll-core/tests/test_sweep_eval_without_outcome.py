"""A sweep job whose last evaluation attempted nothing (an episode collector's `eval/n` 0, no `eval/accuracy`: every
held-out reset failed, say) has no final accuracy, and the sweep says why (roll_core.eval_history):

- the sweep's log for an `ok` job names that evaluation and its counts, not `pipeline.eval_every=0` (which the job
  did not set: it evaluated);
- summary.csv's final_eval_accuracy of a job without a run summary (failed, killed) is the last evaluation's own,
  not the accuracy an earlier evaluation logged (the run summary's rule).

No training, no Ray: hand-made job folders and metrics.jsonl files."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import roll_core.sweep as sweep
from roll_core.sweep import job_value
from roll_core.testing.sweeps import reset_sweep_state

#: Two evaluations with an outcome, then a last one whose 4 held-out resets all failed (step 3 trained only).
HISTORY = [
    {"step": 1, "reward/mean": 0.5, "eval/accuracy": 0.25, "eval/n": 4.0},
    {"step": 2, "reward/mean": 0.5, "eval/accuracy": 0.5, "eval/n": 4.0},
    {"step": 3, "reward/mean": 0.75},
    {"step": 4, "reward/mean": 1.0, "eval/n": 0.0, "eval/reset_failed_episodes": 4.0},
]


@pytest.fixture(autouse=True)
def _fresh_sweep_state(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_sweep_state(monkeypatch)


def _folder(root: Path, history: list[dict[str, Any]]) -> Path:
    root.mkdir(parents=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    return root


def _logged(record: dict[str, Any], caplog: pytest.LogCaptureFixture) -> str:
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="roll_core.sweep"):
        assert job_value(record) is None  # a failed trial for the sweeper
    (message,) = [r.getMessage() for r in caplog.records]
    return message


def test_a_last_evaluation_that_attempted_nothing_is_named_not_eval_every(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The run summary's final accuracy is None (step 4 evaluated nothing): the log blamed pipeline.eval_every=0."""
    job = _folder(tmp_path / "0", HISTORY)
    summary = {"final_eval_accuracy": None, "best_eval_accuracy": 0.5, "skipped": [], "output_dir": str(job)}
    message = _logged({"job": 2, "status": "ok", "summary": summary}, caplog)
    assert "sweep job 2" in message and "eval_every" not in message, message
    assert "last evaluation (step 4) had no outcome (eval/n 0: eval/reset_failed_episodes=4)" in message
    assert "the job's log says why" in message


def test_every_evaluation_attempted_nothing_is_named_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No evaluation ever had an outcome (best None too): metrics.jsonl shows they ran; one over the context."""
    history = [
        {"step": 1, "eval/n": 0.0, "eval/context_refused_episodes": 2.0},
        {"step": 2, "eval/n": 0.0, "eval/context_refused_episodes": 1.0, "eval/aborted_episodes": 1.0},
    ]
    job = _folder(tmp_path / "0", history)
    summary = {"final_eval_accuracy": None, "best_eval_accuracy": None, "skipped": [], "output_dir": str(job)}
    message = _logged({"job": 1, "status": "ok", "summary": summary}, caplog)
    assert "eval_every" not in message, message
    assert "(step 2) had no outcome (eval/n 0: eval/context_refused_episodes=1, eval/aborted_episodes=1)" in message


def test_without_its_metrics_an_earlier_accuracy_still_rules_out_eval_every(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The summary's folder is gone (or unrecorded): a best accuracy proves the job evaluated; with neither, and with
    a folder that logged no evaluation, the eval_every hint stays."""
    summary = {"final_eval_accuracy": None, "best_eval_accuracy": 0.5, "skipped": [], "output_dir": str(tmp_path)}
    message = _logged({"job": 3, "status": "ok", "summary": summary}, caplog)
    assert "its last evaluation had no outcome (eval/n 0)" in message and "eval_every" not in message, message
    trained_only = _folder(tmp_path / "1", [{"step": 1, "reward/mean": 0.5}])
    summary = {"final_eval_accuracy": None, "best_eval_accuracy": None, "skipped": [], "output_dir": str(trained_only)}
    assert "pipeline.eval_every=0" in _logged({"job": 4, "status": "ok", "summary": summary}, caplog)


def test_a_job_without_a_run_summary_has_no_final_accuracy_after_an_evaluation_without_one(tmp_path: Path) -> None:
    """A killed job: its metrics.jsonl's last evaluation (step 4) had no outcome, so its final accuracy is none, not
    step 2's 0.5 (the last logged one), and the error cell says why; best is still 0.5. A killed job whose last
    evaluation had one keeps it."""
    sw = tmp_path / "sweep"
    for job, history in ((0, HISTORY), (1, HISTORY[:3])):
        d = _folder(sw / str(job), history)
        (d / sweep.STATUS_FILE).write_text(
            json.dumps({"job": job, "overrides": [f"algo.lr={job + 1}e-3"], "status": "killed"})
        )
    nothing, earlier = sweep.summarize(sw)
    assert nothing["final_eval_accuracy"] is None  # old: 0.5, step 2's
    assert nothing["best_eval_accuracy"] == 0.5
    assert nothing["error"] == "last evaluation (step 4) had no outcome (eval/n 0: eval/reset_failed_episodes=4)"
    assert (earlier["final_eval_accuracy"], earlier["error"]) == (0.5, "")


def test_an_ok_job_whose_last_evaluation_had_no_outcome_says_so_in_its_row(tmp_path: Path) -> None:
    """The run summary's final accuracy is None: the row's error cell names the evaluation (it was empty)."""
    sw = tmp_path / "sweep"
    d = _folder(sw / "0", HISTORY)
    summary = {"final_eval_accuracy": None, "best_eval_accuracy": 0.5, "skipped": [], "output_dir": str(d)}
    (d / sweep.STATUS_FILE).write_text(json.dumps({"job": 0, "overrides": [], "status": "ok", "summary": summary}))
    (row,) = sweep.summarize(sw)
    assert (row["final_eval_accuracy"], row["best_eval_accuracy"]) == (None, 0.5)
    assert row["error"] == "last evaluation (step 4) had no outcome (eval/n 0: eval/reset_failed_episodes=4)"
