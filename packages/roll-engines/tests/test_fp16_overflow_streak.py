"""fp16 compute: a gradient that overflows fp16 at every loss scale. Every optimizer step is skipped (counted in
`scaler_skipped_steps`, not `nonfinite_steps`: the losses are finite) and the engine reports the longest streak of
skips in a row its call reached, carried across calls (`scaler_skip_streak_max`, what pipeline.max_loss_scale_skips
stops the run on); a step the scaler lets through ends the streak."""

from __future__ import annotations

import pytest

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_engines.train.hf import HFTrainEngine


class _Overflowing(PolicyObjective):
    """The policy loss times 1e30: finite in fp32, but its fp16 activation gradients overflow at any scale >= 2^-30."""

    def __call__(self, outputs: dict, micro: dict) -> tuple:
        loss, m = super().__call__(outputs, micro)
        return loss * 1e30, m


def test_an_overflow_streak_is_counted_across_steps_and_ends_with_a_taken_step(tiny: str) -> None:
    batch = toy_batch(tiny)
    eng = HFTrainEngine(tiny, lr=1e-4, dtype="float16", param_dtype="float32", micro_batch_size=6)
    bad = [eng.train_step(batch, _Overflowing(), mini_batches=2) for _ in range(3)]
    assert [m["scaler_skip_streak_max"] for m in bad] == [2.0, 4.0, 6.0]
    assert all(m["scaler_skipped_steps"] == 2 and m["nonfinite_steps"] == 0 for m in bad)
    assert all(m["optimizer_steps"] == 0 for m in bad)
    assert bad[-1]["loss_scale"] == pytest.approx(2.0**16 / 2**6)  # halved at each skip
    good = eng.train_step(batch, PolicyObjective(), mini_batches=2)
    assert good["optimizer_steps"] == 2 and good["scaler_skip_streak_max"] == 0.0
    again = eng.train_step(batch, _Overflowing(), mini_batches=1)
    assert again["scaler_skip_streak_max"] == 1.0  # a new streak


def test_the_streak_carries_across_a_checkpoint(tiny: str, tmp_path) -> None:
    """A resumed run counted pipeline.max_loss_scale_skips from 0 again (the streak was not in the checkpoint): a run
    that overflows for ever and resumes went on skipping. The streak is saved with the scaler and restored."""
    batch = toy_batch(tiny)
    eng = HFTrainEngine(tiny, lr=1e-4, dtype="float16", param_dtype="float32", micro_batch_size=6)
    eng.train_step(batch, _Overflowing(), mini_batches=2)
    eng.save(tmp_path / "ckpt")
    resumed = HFTrainEngine(tiny, lr=1e-4, dtype="float16", param_dtype="float32", micro_batch_size=6)
    resumed.load(tmp_path / "ckpt")
    assert resumed.train_step(batch, _Overflowing(), mini_batches=1)["scaler_skip_streak_max"] == 3.0
