"""A run killed at any moment loses nothing but the steps after its last complete checkpoint.

Each launch is a real process (tests/e2e/kill_points.py) that sends itself SIGKILL at a chosen point: inside a
checkpoint write (weights written, before state.json; complete but not renamed; renamed but older ones not pruned),
inside a step's update, inside its evaluation. The next launch (`pipeline.resume=true`) continues from the last
complete checkpoint, and the finished run equals one that was never interrupted: the same data order, sampling
and shuffle streams, LR schedule position, adaptive KL coefficient and evaluations, each step logged once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from roll_core.checkpoint import CheckpointError, CheckpointManager
from roll_core.testing import run_pipeline, tiny_overrides
from roll_core.tracking import Tracker

HERE = Path(__file__).parent

COMMON = [
    "algo.kl_coef=0.05",
    "algo.kl_target=0.01",  # the adaptive KL controller: its coefficient is checkpointed state
    "algo.lr_schedule=cosine",  # the scheduler's position is checkpointed state
    "algo.warmup_steps=2",
    "algo.num_mini_batches=2",  # shuffled mini-batches: the SHUFFLE stream
    "pipeline.eval_every=2",
    "pipeline.save_every=2",
    "pipeline.keep_last=1",
    "pipeline.max_steps=5",  # not a multiple of save_every: the last step is saved all the same
]

#: What must match between the killed-and-resumed run and the uninterrupted one, step by step.
KEYS = (
    "reward/mean",
    "response/length_mean",
    "actor/pg_loss",
    "actor/kl_to_ref",
    "actor/kl_coef",
    "actor/lr",
    "eval/accuracy",
)


def _launch(
    overrides: list[str], point: str, step: int, sig: str = "KILL", cli: bool = False
) -> subprocess.CompletedProcess:
    """The run of `overrides` signalled at `point` of `step`; `cli`: run as `roll-train` (its exit status, its printed
    summary) instead of `run_pipeline`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run(
        [sys.executable, str(HERE / "kill_points.py"), *(["--cli"] if cli else []), point, str(step), sig, *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _steps(run: Path) -> list[int]:
    return [h["step"] for h in Tracker.read_metrics(run / "metrics.jsonl")]


def _folders(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").exists() else []


def _summary(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    line = [x for x in proc.stdout.splitlines() if x.startswith("SUMMARY ")][-1]
    return json.loads(line.removeprefix("SUMMARY "))


def _assert_same_run(run: Path, full: list[dict[str, Any]]) -> None:
    """Every step logged once, with the uninterrupted run's numbers."""
    history = Tracker.read_metrics(run / "metrics.jsonl")
    assert [h["step"] for h in history] == [h["step"] for h in full]
    for got, want in zip(history, full):
        for key in KEYS:
            assert (key in got) == (key in want), (got["step"], key)
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (got["step"], key)


# CI time (an in-process reference run and two launches, ~25 s on 2 cores): a partial or unrenamed checkpoint is
# never picked (test_checkpoint_failures.py) and a killed trainer resumes from its latest checkpoint
# (test_faults.py); `nox -s full_matrix` runs this real SIGKILL inside the write.
@pytest.mark.full_matrix
@pytest.mark.slow
def test_a_run_killed_inside_a_checkpoint_write_resumes_from_the_previous_one(seven_task: Path, tmp_path: Path) -> None:
    """SIGKILL with step 4's checkpoint complete and flushed but not yet renamed into place: it is not picked, the
    next launch resumes from step 2, and the finished run (step 5 saved: not a multiple of save_every) equals the
    uninterrupted one with keep_last checkpoints and no partial folder left."""
    _, full = run_pipeline(tiny_overrides(seven_task, tmp_path / "full", *COMMON))
    run = tmp_path / "killed"
    overrides = tiny_overrides(seven_task, run, *COMMON, "pipeline.resume=true")
    p = _launch(overrides, "rename", 4)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert (run / "checkpoints" / "step_000004.tmp" / "state.json").is_file()
    assert _steps(run) == [0, 1, 2, 3, 4] and CheckpointManager(run).latest() == run / "checkpoints" / "step_000002"
    p = _launch(overrides, "update", 99)  # a point never reached: the run finishes
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} at step 3" in p.stderr
    assert _folders(run) == ["step_000005"]
    _assert_same_run(run, full)


def test_a_stop_signal_during_the_evaluation_before_training_ends_the_run_cleanly(
    seven_task: Path, tmp_path: Path
) -> None:
    """SIGTERM (a preemption) while step 0 is evaluated: the evaluation finishes and the run stops before step 1,
    with its summary and report (nothing trained, no checkpoint). It killed the process outright (SIGINT: a
    KeyboardInterrupt traceback), the stop handling starting only with step 1."""
    run = tmp_path / "run"
    p = _launch(tiny_overrides(seven_task, run, *COMMON), "eval", 0, "TERM")
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert _summary(p)["stopped_by_signal"] == signal.SIGTERM
    assert "stopped before step 1: nothing was trained and no checkpoint was written" in p.stderr
    assert _steps(run) == [0] and _folders(run) == []
    assert "status: stopped by signal 15 (no checkpoint to resume from)" in (run / "report.md").read_text()


def test_a_stop_signal_in_the_last_step_completes_the_run_and_roll_train_exits_0(
    seven_task: Path, tmp_path: Path
) -> None:
    """SIGTERM at the start of step 2 of 2: the step trains and is saved, the run is complete. roll-train exited 143
    with `stopped by signal 15`, as if the run had been cut short; its summary now says the run finished and that
    the signal skipped its final evaluation."""
    run = tmp_path / "run"
    overrides = tiny_overrides(seven_task, run, "pipeline.max_steps=2", "pipeline.eval_every=2", "env.eval_size=4")
    p = _launch(overrides, "update", 2, "TERM", cli=True)
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    summary = json.loads(p.stdout[p.stdout.rindex("\n{") + 1 :])  # roll-train prints the summary last
    assert summary["stopped_by_signal"] is None and summary["late_signal"] == signal.SIGTERM
    assert summary["skipped"] == ["final evaluation (step 2)"] and summary["final_eval_accuracy"] is None
    assert summary["status"].startswith("finished: every step trained and saved (step_000002); SIGTERM received")
    assert _steps(run) == [0, 1, 2] and _folders(run) == ["step_000002"]  # step 0: the evaluation before training


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_stop_signal_while_the_pipeline_is_built_shuts_it_down_and_exits_128_plus_n(
    seven_task: Path, tmp_path: Path, sig: str
) -> None:
    """A signal once the roles are up (models loaded, engines started), before the loop's stop handling: one line and
    exit 128+N after the pipeline shut down what it started. SIGINT was a KeyboardInterrupt traceback (exit 1),
    SIGTERM an outright kill (no word, nothing shut down; with cluster=ray Ray's handler aborted: exit 134)."""
    run = tmp_path / "run"
    p = _launch(tiny_overrides(seven_task, run), "build", 0, sig, cli=True)
    assert p.returncode == 128 + signal.Signals[f"SIG{sig}"], (p.returncode, p.stderr[-3000:])
    assert f"roll-train: stopped while building the pipeline (SIG{sig}): nothing was trained" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]
    # released by the run's shutdown: a process killed outright leaves its holder's record (the kernel drops the flock)
    assert (run / ".roll.lock").read_text() == "" and _folders(run) == []


# Six launches (~2 min on 2 cores): the kill points one by one, in one run folder.
@pytest.mark.slow
@pytest.mark.full_matrix
def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_result(seven_task: Path, tmp_path: Path) -> None:
    _, full = run_pipeline(tiny_overrides(seven_task, tmp_path / "full", *COMMON))
    run = tmp_path / "killed"
    overrides = tiny_overrides(seven_task, run, *COMMON, "pipeline.resume=true")
    ckpts = CheckpointManager(run)

    # 1. Killed in its first checkpoint write (the weights written, no state.json): no checkpoint to resume from.
    p = _launch(overrides, "save", 2)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert _steps(run) == [0, 1, 2] and _folders(run) == ["step_000002.tmp"] and ckpts.latest() is None

    # 2. resume=true finds nothing: says so and starts from step 1 (the killed launch's records are dropped).
    #    Killed in step 3's update, after step 2's checkpoint.
    p = _launch(overrides, "update", 3)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert "pipeline.resume=true: no checkpoint in" in p.stderr and "starting from step 1" in p.stderr
    assert _steps(run) == [0, 1, 2] and _folders(run) == ["step_000002"]  # step 0: the evaluation before training

    # 3. Resumed from step 2; killed inside step 4's evaluation (step 4 trained, not logged, not saved).
    p = _launch(overrides, "eval", 4)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} at step 3" in p.stderr
    assert _steps(run) == [0, 1, 2, 3] and _folders(run) == ["step_000002"]

    # 4. Killed with step 4's checkpoint complete and flushed but not renamed: it is not a checkpoint.
    p = _launch(overrides, "rename", 4)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert (run / "checkpoints" / "step_000004.tmp" / "state.json").is_file()
    assert _steps(run) == [0, 1, 2, 3, 4] and ckpts.latest() == run / "checkpoints" / "step_000002"

    # 5. Resumed from step 2 again; killed after step 4's checkpoint is in place, before step 2's is pruned.
    p = _launch(overrides, "prune", 4)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} at step 3" in p.stderr
    assert _folders(run) == ["step_000002", "step_000004"]

    # 6. Resumed from step 4 and finished: step 5 (not a multiple of save_every) is saved, keep_last=1 holds, no
    #    partial folder is left, and every step is logged once with the uninterrupted run's numbers.
    p = _launch(overrides, "update", 99)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_000004'} at step 5" in p.stderr
    assert _summary(p)["stopped_by_signal"] is None
    assert _folders(run) == ["step_000005"]
    _assert_same_run(run, full)
    assert json.loads((run / "checkpoints" / "step_000005" / "state.json").read_text())["step"] == 5


def test_a_full_disk_during_a_save_ends_the_run_with_the_previous_checkpoint_intact(
    seven_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC from inside the train engine's writer (its scheduler state, after the weights): the partial folder is
    deleted (it held the space the user must free), step 2's checkpoint is untouched, and the error says so."""
    import errno

    import torch

    real_save = torch.save

    def full_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if str(f).endswith("engine.pt") and "step_000004.tmp" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    run = tmp_path / "run"
    with pytest.raises(CheckpointError) as info:
        run_pipeline(tiny_overrides(seven_task, run, *COMMON))
    step2 = run / "checkpoints" / "step_000002"
    assert str(info.value).startswith("step 4: the checkpoint could not be written (")
    assert f"the latest complete checkpoint, {step2}, is intact" in str(info.value)
    assert "The disk is full" in str(info.value)
    assert _folders(run) == ["step_000002"] and CheckpointManager(run).latest() == step2
    assert (step2 / "actor" / "engine.pt").is_file() and json.loads((step2 / "state.json").read_text())["step"] == 2
    assert "status: failed: CheckpointError: step 4" in (run / "report.md").read_text()
