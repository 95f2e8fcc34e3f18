"""What a sweep logs for an `ok` job with no finite final accuracy (roll_core.sweep.job_value): a final evaluation
a stop skipped is named as such (the run summary's `skipped`), not blamed on pipeline.eval_every=0; a job that
logged no evaluation still gets that hint; either way the sweeper gets None (a failed trial)."""

from __future__ import annotations

import logging

import pytest

from roll_core.sweep import job_value


def test_a_skipped_final_evaluation_is_named(caplog: pytest.LogCaptureFixture) -> None:
    summary = {"final_eval_accuracy": None, "skipped": ["evaluation (step 2)", "final evaluation (step 4)"]}
    with caplog.at_level(logging.ERROR, logger="roll_core.sweep"):
        assert job_value({"job": 3, "status": "ok", "summary": summary}) is None
    (message,) = [r.getMessage() for r in caplog.records]
    assert "sweep job 3" in message and "final evaluation (step 4)" in message
    assert "skipped" in message and "eval_every" not in message


def test_no_evaluation_at_all_keeps_the_eval_every_hint(caplog: pytest.LogCaptureFixture) -> None:
    summary = {"final_eval_accuracy": None, "skipped": []}
    with caplog.at_level(logging.ERROR, logger="roll_core.sweep"):
        assert job_value({"job": 5, "status": "ok", "summary": summary}) is None
        assert job_value({"job": 6, "status": "ok", "summary": {"final_eval_accuracy": float("nan")}}) is None
    first, second = [r.getMessage() for r in caplog.records]
    assert "sweep job 5" in first and "pipeline.eval_every=0" in first
    assert "sweep job 6" in second and "non-finite" in second and "eval_every" not in second
    assert job_value({"job": 7, "status": "ok", "summary": {"final_eval_accuracy": 0.5}}) == 0.5
