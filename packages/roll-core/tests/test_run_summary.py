"""A run's summary and status line (roll_core.pipelines._run_summary), from hand-made histories: what a resumed run
says about the evaluations a stop skipped before the resume, and the statuses the loop's end tests pin down."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from roll_core.pipelines._run_summary import end_status, restored_skips, run_summary

HISTORY = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "eval/accuracy": 0.5}, {"step": 2, "reward/mean": 1.0}]


def _summary(skipped: list[int], signum: int | None = None, late: int | None = None) -> dict[str, Any]:
    return run_summary(
        HISTORY, skipped, wall_seconds=1.0, output_dir="run", signum=signum, late=late, collector_summary={"x": 1}
    )


def _status(summary: dict[str, Any], ckpt: Path | None, **kw: Any) -> str:
    kw = {"stop_checkpoint": None, "exhausted": True, "max_steps": 2, **kw}
    return end_status(summary, HISTORY, healthy_checkpoint=ckpt, **kw)


def test_a_resumed_complete_runs_status_names_the_evaluations_skipped_before_the_resume(tmp_path: Path) -> None:
    """No signal in this process, step 2's evaluation skipped in an earlier one: the status named nothing."""
    ckpt = tmp_path / "checkpoints" / "step_000002"
    final = _summary([2])
    assert final["final_eval_accuracy"] is None and final["skipped"] == ["final evaluation (step 2)"]
    assert _status(final, ckpt) == (
        "finished: every step trained and saved (step_000002); a stop before the resume skipped the final "
        f"evaluation (step 2) (roll-eval {ckpt} gives it)"
    )
    # an earlier evaluation (the final one ran): named, no roll-eval of the last checkpoint offered for it
    earlier = _summary([1])
    assert earlier["final_eval_accuracy"] == 0.5 and earlier["skipped"] == ["evaluation (step 1)"]
    assert _status(earlier, ckpt) == (
        "finished: every step trained and saved (step_000002); a stop before the resume skipped the evaluation (step 1)"
    )
    assert _status(_summary([]), ckpt) == "finished"


def test_the_other_statuses_are_as_the_loop_wrote_them(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints" / "step_000002"
    late = _summary([2], late=15)
    assert _status(late, ckpt) == (
        "finished: every step trained and saved (step_000002); SIGTERM received at the end skipped the final "
        f"evaluation (step 2) (roll-eval {ckpt} gives it)"
    )
    assert _status(_summary([], late=15), tmp_path / "step_000001") == (
        "finished: every step trained (latest checkpoint step_000001); SIGTERM received at the end skipped nothing"
    )
    stopped = _summary([2], signum=15)
    assert stopped["final_eval_accuracy"] == 0.5 and stopped["skipped"] == ["evaluation (step 2)"]
    assert _status(stopped, ckpt, stop_checkpoint=ckpt) == "stopped by signal 15 (resume from step_000002)"
    assert _status(stopped, None) == "stopped by signal 15 (no checkpoint to resume from)"
    partial = _summary([])
    assert _status(partial, ckpt, exhausted=False).startswith("stopped at pipeline.max_steps=2 before the job")
    assert partial["incomplete"] is True


def test_a_checkpoint_keeps_the_skips_up_to_its_step() -> None:
    assert restored_skips({"step": 3, "skipped_evals": [2, "3", 5]}) == [2, 3]
    assert restored_skips({"step": 3}) == []


def test_the_final_accuracy_is_the_one_rule_of_roll_core_eval_history() -> None:
    """The summary's final_eval_accuracy and what report.md and the sweeps read as the last evaluation's accuracy
    (roll_core.eval_history.last_eval_accuracy) were two copies of one rule: the summary now calls the shared one, so
    they cannot drift apart."""
    import roll_core.pipelines._run_summary as run_summary_module
    from roll_core.eval_history import last_eval_accuracy

    assert run_summary_module.last_eval_accuracy is last_eval_accuracy
    nan = float("nan")
    histories = [
        HISTORY,
        [*HISTORY, {"step": 3, "eval/n": 0.0, "eval/reset_failed_episodes": 2.0}],  # no outcome: None, not 0.5
        [{"step": 0, "eval/accuracy": nan, "eval/n": 0.0}],  # a NaN as logged
        [{"step": 1, "reward/mean": 1.0}],  # nothing evaluated
    ]
    for history in histories:
        s = run_summary(history, [], wall_seconds=1.0, output_dir="run", signum=None, late=None, collector_summary={})
        expected = last_eval_accuracy(history)
        assert s["final_eval_accuracy"] is expected or s["final_eval_accuracy"] == expected, history
    assert [last_eval_accuracy(h) for h in (histories[0], histories[1], histories[3])] == [0.5, None, None]
