"""The training loop's bookkeeping on the tiny model: the progress bar counts the step a run stops in, a run resumed
at or past pipeline.max_steps says there is nothing to train, a stop in a run's last step (or the step that finishes
a rollout-only job) completes the run and says what it skipped, and the weight sync an off-policy collector does
before evaluating is timed."""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
from tqdm.std import tqdm as std_tqdm

from roll_core.testing import run_pipeline, tiny_overrides


class _RecordedBar(std_tqdm):
    """A tqdm that records where each step bar stood when it closed: (n, total)."""

    closed: ClassVar[list[tuple[int, int | None]]] = []
    monitor_interval = 0  # no monitor thread left behind

    def close(self) -> None:
        if not self.disable and self.unit == "step":
            _RecordedBar.closed.append((self.n, self.total))
        super().close()


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int | None]]:
    import tqdm.auto

    from roll_core.pipelines import _console

    _RecordedBar.closed = []
    monkeypatch.setattr(tqdm.auto, "tqdm", _RecordedBar)
    monkeypatch.setattr(_console, "_is_terminal", lambda stream: True)  # pytest's stderr is not one: no bar there
    return _RecordedBar.closed


def test_a_stopped_runs_bar_counts_its_last_step_and_a_resume_past_max_steps_says_so(
    seven_task: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sigterm_in_step: Callable[[int], None],
    bars: list[tuple[int, int | None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGTERM in step 2 of 4: step 2 is logged and saved without its evaluation (the checkpoint first), and the
    bar ends at 2/4 (it showed 1/4: iterating a tqdm counts a step when the next one starts). Resumed with
    pipeline.max_steps=2, nothing is left to train: a warning says so (the run reported "finished" without a word)."""
    run = tmp_path / "run"
    base = tiny_overrides(seven_task, run, "pipeline.progress=true", "pipeline.trackers=[]")
    base = [o for o in base if not o.startswith("pipeline.eval_every=")]
    sigterm_in_step(2)
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.loop"):
        summary, history = run_pipeline([*base, "pipeline.max_steps=4", "pipeline.eval_every=1"])
    assert summary["stopped_by_signal"] == signal.SIGTERM
    assert [h["step"] for h in history if h["step"] > 0] == [1, 2]
    # the checkpoint comes before a due evaluation once a stop is requested (a preemption's grace period)
    evaluated = [h["step"] for h in history if "eval/accuracy" in h]
    assert 1 in evaluated and 2 not in evaluated
    assert "step 2: evaluation skipped: stopping" in caplog.text
    caplog.clear()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    assert bars == [(2, 4)]
    monkeypatch.undo()  # no more signals; the recorder goes too
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.loop"):
        summary, history = run_pipeline([*base, "pipeline.max_steps=2", "pipeline.resume=true"])
    assert "resumed after step 2, pipeline.max_steps=2: no step left to train" in caplog.text
    assert summary["stopped_by_signal"] is None and [h["step"] for h in history if h["step"] > 0] == [1, 2]


def test_a_sigterm_in_the_last_step_completes_the_run_and_a_resume_trains_nothing(
    stopped_run: Callable[[int, int], tuple[Path, list[str]]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGTERM in step 2 of 2, after its update: the step is logged and saved, its evaluation skipped (the checkpoint
    first), and the run is complete, not stopped (it was `stopped by signal 15`, exit 143 from roll-train): the
    summary and report.md say so and name what the signal skipped. A resume trains nothing."""
    run, base = stopped_run(2, stop_in=2)
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.loop"):
        summary, history = run_pipeline(base)
    assert summary["stopped_by_signal"] is None and summary["late_signal"] == signal.SIGTERM
    assert summary["skipped"] == ["final evaluation (step 2)"]
    # step 1's accuracy would pass for the final model's
    assert summary["final_eval_accuracy"] is None and summary["best_eval_accuracy"] is not None
    assert [h["step"] for h in history] == [0, 1, 2] and [h["step"] for h in history if "eval/accuracy" in h] == [0, 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    status = (run / "report.md").read_text().splitlines()[2]
    assert status == (
        "- status: finished: every step trained and saved (step_000002); SIGTERM received at the end skipped the "
        f"final evaluation (step 2) (roll-eval {run / 'checkpoints' / 'step_000002'} gives it)"
    )
    assert "SIGTERM received in the last step (2): the step completed and was saved" in caplog.text
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.loop"):
        again, resumed = run_pipeline([*base, "pipeline.resume=true"])
    assert "resumed after step 2, pipeline.max_steps=2: no step left to train" in caplog.text
    assert resumed == history and again["stopped_by_signal"] is None


def test_a_stop_in_the_step_that_finishes_a_rollout_job_completes_it(
    tmp_path: Path, sigterm_in_step: Callable[[int], None], bars: list[tuple[int, int | None]]
) -> None:
    """A rollout-only job of 3 steps, SIGTERM in step 3 (its last): the job is complete (every prompt generated, the
    checkpoint written), not stopped, and report.md names that checkpoint; the bar ends at 3/3 (it showed 2/3)."""
    out = tmp_path / "run"
    sigterm_in_step(3)
    summary, history = run_pipeline(
        [
            "pipeline=rollout",
            "model=tiny",
            "model.max_response_length=6",
            "env=arithmetic",
            "env.train_size=10",
            "env.eval_size=4",
            "pipeline.rollout_batch_size=3",
            "pipeline.progress=true",
            "pipeline.trackers=[]",
            f"pipeline.output_dir={out}",
            "rollout.samples_per_prompt=2",
            "rollout.max_prompts=7",
        ]
    )
    assert summary["stopped_by_signal"] is None and summary["late_signal"] == signal.SIGTERM
    assert [h["step"] for h in history if h["step"] > 0] == [1, 2, 3]
    assert json.loads((out / "checkpoints" / "step_000003" / "state.json").read_text())["step"] == 3
    status = "finished: every step trained and saved (step_000003); SIGTERM received at the end skipped nothing"
    assert f"- status: {status}\n" in (out / "report.md").read_text()
    assert bars == [(3, 3)]


def test_the_sync_before_an_off_policy_evaluation_is_timed(tmp_path: Path) -> None:
    """SFT (no sampling while it trains) pushes the weights only before it evaluates: that sync's seconds are in
    perf/time_sync (step() had copied the phase timers before it, so they were missing)."""
    rows = tmp_path / "sft.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q{i}: say 7", "completion": "7"}) + "\n" for i in range(16)))
    from roll_core.testing import constant_answer_task

    seven = constant_answer_task(tmp_path / "seven.jsonl")
    dropped = ("algo.", "pipeline.eval_every", "env.eval_size")
    base = [o for o in tiny_overrides(seven, tmp_path / "run") if not o.startswith(dropped)]
    _, history = run_pipeline(
        [
            *base,
            "pipeline=sft",
            f"data.path={rows}",
            "data.eval_size=4",
            "env.eval_size=4",
            "algo.lr=3e-3",
            "pipeline.rollout_batch_size=4",
            "pipeline.max_steps=3",
            "pipeline.eval_every=2",
            "pipeline.trackers=[]",
        ]
    )
    steps = {h["step"]: h for h in history if h["step"] > 0}
    assert [s for s, h in steps.items() if "sync/weight_version" in h] == [2, 3]  # the evaluated steps
    assert all(steps[s]["perf/time_sync"] > 0 for s in (2, 3))
    assert "perf/time_sync" not in steps[1]
