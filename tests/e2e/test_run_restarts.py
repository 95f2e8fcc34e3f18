"""Run restarts (roll_core.pipelines.run_control.run_with_restarts) on the local backend: a fault the run cannot
repair in place rebuilds it from its latest checkpoint and the finished run equals the uninterrupted one; a bug,
a fault before the first checkpoint and a fault past `pipeline.max_run_restarts` end the run. The faults here are
raised as WorkerDiedError from a step (the local backend has no processes to kill); tests/e2e/test_faults.py kills
a real trainer actor on Ray."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from roll_core.cluster.group import WorkerDiedError
from roll_core.config import load_config
from roll_core.pipelines.run_control import run_with_restarts
from roll_core.testing import run_pipeline, tiny_overrides
from roll_core.tracking import Tracker

COMMON = ["algo=grpo", "pipeline.max_steps=4", "pipeline.save_every=2", "algo.ppo_epochs=2", "algo.kl_coef=0.01"]


def faulty(fail: Callable[[int, int], BaseException | None]) -> tuple[Callable[[Any], Any], list[Any]]:
    """A pipeline factory whose incarnation i raises `fail(i, step)` (when not None) at the start of that step."""
    from roll_core.cli import pipeline_class

    built: list[Any] = []

    def make(cfg: Any) -> Any:
        pipeline = pipeline_class(cfg.pipeline.name)(cfg)
        incarnation, step = len(built), pipeline.step

        def failing_step(n: int) -> dict[str, Any]:
            exc = fail(incarnation, n)
            if exc is not None:
                raise exc
            return step(n)

        pipeline.step = failing_step
        built.append(pipeline)
        return pipeline

    return make, built


def test_a_dead_trainer_restarts_the_run_from_its_checkpoint_and_nothing_is_lost(
    seven_task: Path, tmp_path: Path
) -> None:
    _, full = run_pipeline(tiny_overrides(seven_task, tmp_path / "full", *COMMON))
    make, built = faulty(lambda i, step: WorkerDiedError("actor_train rank 0 died") if (i, step) == (0, 4) else None)
    summary = run_with_restarts(make, load_config(tiny_overrides(seven_task, tmp_path / "restarted", *COMMON)))
    assert len(built) == 2 and built[1].start_step == 3  # resumed from step 2's checkpoint, steps 3-4 redone
    assert summary["run_restarts"] == 1
    history = Tracker.read_metrics(tmp_path / "restarted" / "metrics.jsonl")
    assert [h["step"] for h in history] == [1, 2, 3, 4]  # the failed incarnation's step 3 was truncated away
    assert [h["faults/run_restarts"] for h in history] == [0, 0, 1, 0]
    by_step = {h["step"]: h for h in full}
    for h in history:
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_to_ref", "response/length_mean"):
            assert h[key] == pytest.approx(by_step[h["step"]][key], rel=1e-5, abs=1e-6), (h["step"], key)


def test_an_async_run_restarts_too(seven_task: Path, tmp_path: Path) -> None:
    """With rollout running ahead (async_ratio=1), the failed incarnation's background rollout is stopped and the
    restarted run generates afresh from the checkpoint (batches differ from an uninterrupted async run's: their
    behaviour versions do), finishing every step once."""
    import threading

    threads = threading.active_count()
    make, built = faulty(lambda i, step: WorkerDiedError("actor_train rank 0 died") if (i, step) == (0, 4) else None)
    extra = ["pipeline.async_ratio=1", "algo.off_policy_correction=token"]
    summary = run_with_restarts(make, load_config(tiny_overrides(seven_task, tmp_path, *COMMON, *extra)))
    assert summary["run_restarts"] == 1 and built[1].start_step == 3
    history = Tracker.read_metrics(tmp_path / "metrics.jsonl")
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert [h["faults/run_restarts"] for h in history] == [0, 0, 1, 0]
    assert all(h["async/staleness_max"] <= 1 for h in history)
    # Neither incarnation left threads behind (the local backend tears its engines down, tqdm's monitor aside).
    left = [t.name for t in threading.enumerate() if t.name != "tqdm_monitor"]
    assert len(left) <= threads, left


def _stop_then_die() -> BaseException:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGTERM)  # GracefulStop turns it into a stop request
    return WorkerDiedError("actor_train rank 0 died")


@pytest.mark.parametrize(
    ("fail", "raised", "incarnations"),
    [
        # A bug is not a fault (every worker is alive): restarting would only repeat it.
        (lambda i, step: ValueError("a bug") if step == 3 else None, ValueError, 1),
        # A fault before the first checkpoint: nothing to restart from.
        (lambda i, step: WorkerDiedError("died") if step == 1 else None, WorkerDiedError, 1),
        # A fault in every incarnation: max_run_restarts=1 allows one restart, the second fault ends the run.
        (lambda i, step: WorkerDiedError("died") if step == 3 else None, WorkerDiedError, 2),
        # A stop signal and a fault in the same step (a preemption): the run stops, not rebuilt to train on (the
        # rebuilt run forgot the signal and trained to max_steps, exit 0).
        (lambda i, step: _stop_then_die() if step == 3 else None, WorkerDiedError, 1),
    ],
    ids=["bug", "no_checkpoint", "budget", "stop_signal"],
)
def test_errors_that_a_restart_cannot_repair_end_the_run(
    fail: Callable[[int, int], BaseException | None],
    raised: type[BaseException],
    incarnations: int,
    seven_task: Path,
    tmp_path: Path,
) -> None:
    make, built = faulty(fail)
    cfg = load_config(tiny_overrides(seven_task, tmp_path, *COMMON, "pipeline.max_run_restarts=1"))
    with pytest.raises(raised):
        run_with_restarts(make, cfg)
    assert len(built) == incarnations


def test_a_stopped_run_says_which_checkpoint_it_resumes_from(seven_task: Path, tmp_path: Path) -> None:
    """SIGTERM in step 3: the step finishes, its checkpoint is written, and report.md names it (the status said
    "checkpoint written" even where none was, inside a non-finite streak)."""
    import os
    import signal

    def sigterm() -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    make, _ = faulty(lambda i, step: sigterm() if step == 3 else None)
    summary = run_with_restarts(make, load_config(tiny_overrides(seven_task, tmp_path, *COMMON)))
    assert summary["stopped_by_signal"] == signal.SIGTERM
    assert f"stopped by signal {int(signal.SIGTERM)} (resume from step_000003)" in (tmp_path / "report.md").read_text()
