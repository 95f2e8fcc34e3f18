"""A resume that changes the optimizer steps per training step says, in one INFO line, that the train engines
re-base the LR schedule and where (roll_core.pipelines._resume_schedule; the engines' own rule and its test:
roll_engines.train._settings.rebased, packages/roll-engines/tests/test_resume_lr_rebase.py; a whole resumed run:
tests/e2e/test_resume_lr_rebase.py). The schedule counts optimizer steps, so 2 mini-batches -> 1 at step 2 of 4
under a cosine schedule put it at its end, and the rest of the run trained at LR 0."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from roll_core.checkpoint import CheckpointManager
from roll_core.config import load_config
from roll_core.config.resume import config_dict
from roll_core.pipelines._resume_schedule import _multiplier, log_schedule_rebase, schedule_rebase

BASE = ["model=tiny", "pipeline.max_steps=4", "pipeline.rollout_batch_size=4", "algo.group_size=8"]


def _cfg(*extra: str):
    return load_config([*BASE, *extra])


def test_fewer_mini_batches_under_a_decaying_schedule_is_said_with_the_lr_the_run_goes_on_at(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _cfg("algo.lr_schedule=cosine", "algo.num_mini_batches=2")
    mgr = CheckpointManager(tmp_path, keep_last=1, config=config_dict(saved))
    folder = mgr.commit(mgr.staging(2), 2, {})
    with caplog.at_level(logging.INFO, logger="roll_core.pipelines._resume_schedule"):
        message = log_schedule_rebase(folder, _cfg("algo.lr_schedule=cosine", "algo.num_mini_batches=1"))
    assert message is not None and message in caplog.text
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # no warning: nothing is left to do
    # the checkpoint counted 2 x 2 optimizer steps, a run planned with one mini-batch would be at 2 of 4 (cosine:
    # half the LR); the count stayed 4 of 4 before, the schedule's end (LR 0)
    assert "from the checkpoint's optimizer step 4 to 2 of 4" in message and "(LR 0.5 x algo.lr)" in message


@pytest.mark.parametrize(
    ("saved", "now", "step", "positions"),
    [
        # more optimizer steps per step: 2 x 1 -> 2 x 2 of 8
        (["algo.lr_schedule=linear"], ["algo.lr_schedule=linear", "algo.ppo_epochs=2"], 2, "2 to 4 of 8"),
        # a constant schedule: the count moves all the same (the LR is algo.lr at both positions)
        (["algo.num_mini_batches=2"], ["algo.num_mini_batches=1"], 2, "4 to 2 of 4"),
        # pipeline.max_steps alone: the count stays, a run planned with the new length's
        (["algo.lr_schedule=cosine"], ["algo.lr_schedule=cosine", "pipeline.max_steps=8"], 2, None),
        # mini-batches from algo.mini_batch_size: a changed rollout_batch_size changes their number (32 rows / 16
        # -> 16 / 16)
        (
            ["algo.lr_schedule=cosine", "algo.mini_batch_size=16"],
            ["algo.lr_schedule=cosine", "algo.mini_batch_size=16", "pipeline.rollout_batch_size=2"],
            1,
            "2 to 1 of 4",
        ),
    ],
)
def test_a_change_of_the_steps_per_training_step_is_said_with_both_positions(
    saved: list[str], now: list[str], step: int, positions: str | None
) -> None:
    message = schedule_rebase(config_dict(_cfg(*saved)), _cfg(*now), step)
    if positions is None:
        assert message is None
    else:
        assert message is not None and f"from the checkpoint's optimizer step {positions}," in message


def test_a_config_of_another_shape_is_not_compared() -> None:
    assert schedule_rebase({"algo": {"lr": 1e-4}}, _cfg("algo.num_mini_batches=2"), 2) is None


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_the_multiplier_is_the_engines_schedule(schedule: str) -> None:
    from roll_engines.train._optim import lr_lambda

    for warmup, total in [(0, 8), (3, 8), (8, 8), (2, 1)]:
        fn = lr_lambda(schedule, warmup, total)
        assert [_multiplier(schedule, warmup, total, s) for s in range(12)] == [fn(s) for s in range(12)]
