"""A resume that changes the optimizer steps per training step is warned about with where the LR schedule goes on
(roll_core.pipelines._resume_schedule): the schedule counts optimizer steps, so 2 mini-batches -> 1 at step 2 of 4
under a cosine schedule put it at its end, and the rest of the run trained at LR 0 with no warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from roll_core.checkpoint import CheckpointManager
from roll_core.config import load_config
from roll_core.config.resume import config_dict
from roll_core.pipelines._resume_schedule import _multiplier, schedule_shift, warn_schedule_shift

BASE = ["model=tiny", "pipeline.max_steps=4", "pipeline.rollout_batch_size=4", "algo.group_size=8"]


def _cfg(*extra: str):
    return load_config([*BASE, *extra])


def test_fewer_mini_batches_under_a_decaying_schedule_is_warned_with_the_lr_it_ends_at(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _cfg("algo.lr_schedule=cosine", "algo.num_mini_batches=2")
    mgr = CheckpointManager(tmp_path, keep_last=1, config=config_dict(saved))
    folder = mgr.commit(mgr.staging(2), 2, {})
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines._resume_schedule"):
        message = warn_schedule_shift(folder, _cfg("algo.lr_schedule=cosine", "algo.num_mini_batches=1"))
    assert message is not None and message in caplog.text
    # the checkpoint counted 2 x 2 optimizer steps: the new plan's 4 of 4 (the end), where a run planned with one
    # mini-batch would be at 2 (cosine: half the LR)
    assert "up to 4 of 4" in message and "would be at 2" in message
    assert "the LR is 0 x algo.lr instead of 0.5 x" in message and "train at LR 0" in message


@pytest.mark.parametrize(
    ("saved", "now", "step", "warned"),
    [
        # more optimizer steps per step: the schedule lags behind a run planned so (no end reached)
        (["algo.lr_schedule=linear"], ["algo.lr_schedule=linear", "algo.ppo_epochs=2"], 2, True),
        # a constant schedule past its warm-up either way: the LR is algo.lr at both positions
        (["algo.num_mini_batches=2"], ["algo.num_mini_batches=1"], 2, False),
        # a constant schedule still in its warm-up by one count: the warm-up's LR differs
        (["algo.warmup_steps=6", "algo.num_mini_batches=2"], ["algo.warmup_steps=6"], 2, True),
        # pipeline.max_steps alone: the count is a run planned with the new length's
        (["algo.lr_schedule=cosine"], ["algo.lr_schedule=cosine", "pipeline.max_steps=8"], 2, False),
        # mini-batches from algo.mini_batch_size: a changed rollout_batch_size changes their number
        (
            ["algo.lr_schedule=cosine", "algo.mini_batch_size=16"],
            ["algo.lr_schedule=cosine", "algo.mini_batch_size=16", "pipeline.rollout_batch_size=2"],
            1,
            True,
        ),
    ],
)
def test_only_a_change_that_moves_the_lr_is_warned(saved: list[str], now: list[str], step: int, warned: bool) -> None:
    message = schedule_shift(config_dict(_cfg(*saved)), _cfg(*now), step)
    assert (message is not None) == warned, message
    if warned:
        assert "train at LR 0" not in message  # none of these reaches the end of the schedule


def test_a_config_of_another_shape_is_not_compared() -> None:
    assert schedule_shift({"algo": {"lr": 1e-4}}, _cfg("algo.num_mini_batches=2"), 2) is None


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_the_multiplier_is_the_engines_schedule(schedule: str) -> None:
    from roll_engines.train._optim import lr_lambda

    for warmup, total in [(0, 8), (3, 8), (8, 8), (2, 1)]:
        fn = lr_lambda(schedule, warmup, total)
        assert [_multiplier(schedule, warmup, total, s) for s in range(12)] == [fn(s) for s in range(12)]
