"""A run stopped at step 1 of 2 and resumed with other mini-batches goes on at the LR a run with the new settings
would have: the train engines re-base the LR schedule's optimizer-step count (roll_engines.train._settings.rebased),
the actor's and the critic's alike. Before, 2 mini-batches -> 1 under a cosine schedule read the saved count 2 as
optimizer step 2 of the new plan's 2, its end: step 2 trained at LR 0."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from roll_core.testing import run_pipeline, tiny_overrides

COMMON = [
    "algo=ppo",
    "algo.lr_schedule=cosine",
    "pipeline.max_steps=2",
    "pipeline.rollout_batch_size=2",
    "pipeline.trackers=[]",
]


def test_a_resume_with_fewer_mini_batches_trains_at_the_lr_of_a_run_planned_so(
    seven_task: Path,
    tmp_path: Path,
    sigterm_in_step: Callable[[int], None],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, planned = run_pipeline(tiny_overrides(seven_task, tmp_path / "planned", *COMMON, "algo.num_mini_batches=1"))
    run = tmp_path / "resumed"
    sigterm_in_step(1)
    first, _ = run_pipeline(tiny_overrides(seven_task, run, *COMMON, "algo.num_mini_batches=2"))
    assert first["stopped_by_signal"] is not None
    monkeypatch.undo()  # no more signals
    with caplog.at_level(logging.INFO, logger="roll_core.pipelines._resume_schedule"):
        _, resumed = run_pipeline(
            tiny_overrides(seven_task, run, *COMMON, "algo.num_mini_batches=1", "pipeline.resume=true")
        )
    assert "from the checkpoint's optimizer step 2 to 1 of 2" in caplog.text
    (want,) = [h for h in planned if h["step"] == 2 and "actor/lr" in h]
    (got,) = [h for h in resumed if h["step"] == 2 and "actor/lr" in h]
    for key in ("actor/lr", "critic/lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    assert got["actor/lr"] > 0  # cosine at optimizer step 1 of 2: half algo.lr (0 before: the schedule's end)
