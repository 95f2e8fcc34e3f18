"""A train engine refuses an unknown LR schedule when it is built: the multiplier read the name only past the
warm-up, so an engine built with a misspelt one trained through its warm-up and failed mid-run (or never, on a run
no longer than its warm-up, which then trained at a constant LR)."""

from __future__ import annotations

import pytest

from roll_engines.train._optim import lr_lambda
from roll_engines.train.hf import HFTrainEngine


def test_an_unknown_schedule_is_refused_before_any_step(tiny: str) -> None:
    with pytest.raises(ValueError, match="unknown lr schedule 'cosin'; choose one of constant, cosine, linear"):
        HFTrainEngine(tiny, lr_schedule="cosin", warmup_steps=2, total_steps=10)
    with pytest.raises(ValueError, match="unknown lr schedule 'Linear'"):
        lr_lambda("Linear", warmup_steps=4, total_steps=4)  # a run no longer than its warm-up


def test_known_schedules_keep_their_multipliers() -> None:
    assert [round(lr_lambda("linear", 2, 6)(s), 3) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert [lr_lambda("constant", 0, 3)(s) for s in range(3)] == [1.0, 1.0, 1.0]
