"""The progress bar's postfix (roll_core.pipelines.loop.progress_fields): the held-out accuracy of the latest
evaluation is on the bar, and stays there on the steps between evaluations."""

from __future__ import annotations

from roll_core.pipelines.loop import progress_fields


def test_the_held_out_accuracy_is_shown_and_kept_between_evaluations() -> None:
    """The console showed the training batch's `acc` only: the held-out accuracy, the quickstart's headline number,
    appeared nowhere until the run's summary."""
    evaluated = progress_fields(
        {"reward/mean": 0.5, "reward/accuracy": 0.25, "eval/accuracy": 0.6875, "perf/step_seconds": 7.23}
    )
    assert evaluated == {"reward": "0.500", "acc": "0.25", "eval_acc": "0.69", "sec": "7.2"}
    later = progress_fields({"reward/mean": 0.75, "reward/accuracy": 0.5, "perf/step_seconds": 4.0}, evaluated)
    assert later == {"reward": "0.750", "acc": "0.50", "eval_acc": "0.69", "sec": "4.0"}
    assert list(later) == ["reward", "acc", "eval_acc", "sec"]  # the same order on every step: the bar does not jump


def test_no_evaluation_yet_shows_no_held_out_accuracy() -> None:
    """Nothing is made up: a run with pipeline.eval_every=0 (or before its first evaluation) shows none."""
    assert progress_fields({"reward/mean": 0.0, "perf/step_seconds": 1.0}) == {"reward": "0.000", "sec": "1.0"}
    assert progress_fields({"reward/mean": 0.0}, {"reward": "0.000"}) == {"reward": "0.000"}
