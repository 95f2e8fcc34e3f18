"""The `lr` train metric of the hf and fsdp2 engines is the learning rate the step's optimizer steps applied (their
mean), read off the optimizer as it steps; a step that took none reports the rate the next one will apply. It was
the schedule's value after the step: with a warm-up of 4, a step that trained at lr/4 logged lr/2. (Megatron's is
checked against hf's in test_megatron.py.)"""

from __future__ import annotations

import pytest

from roll_core.pipelines.objectives import PolicyObjective
from roll_engines.train.hf import HFTrainEngine

LR, WARMUP = 1e-2, 4


class NanLoss(PolicyObjective):
    """The policy loss times NaN: every optimizer step of the mini-batch is skipped."""

    def __call__(self, outputs: dict, micro: dict) -> tuple:
        loss, m = super().__call__(outputs, micro)
        return loss * float("nan"), m


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_the_logged_lr_is_the_rate_the_optimizer_applied(tiny: str, kind: str) -> None:
    import torch.distributed as dist

    from roll_core.testing.batches import toy_batch
    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    batch = toy_batch(tiny)
    kw = dict(lr=LR, warmup_steps=WARMUP, total_steps=10, micro_batch_size=3)
    try:
        eng = FSDP2TrainEngine.conformance_engine(tiny, **kw) if kind == "fsdp2" else HFTrainEngine(tiny, **kw)
        applied: list[float] = []  # the rate of every optimizer step, as AdamW reads it when it steps
        eng.optimizer.register_step_pre_hook(lambda opt, *_: applied.append(float(opt.param_groups[0]["lr"])))

        out = eng.train_step(batch, PolicyObjective(), mini_batches=1)
        assert applied == pytest.approx([LR / 4])  # the warm-up's first step
        assert out["lr"] == pytest.approx(LR / 4)  # (logged LR x 2/4 before)

        out = eng.train_step(batch, PolicyObjective(), mini_batches=2)  # two steps, the schedule moves between them
        assert applied[1:] == pytest.approx([LR * 2 / 4, LR * 3 / 4])
        assert out["lr"] == pytest.approx(LR * 5 / 8)  # their mean (logged LR x 4/4 before)

        skipped = eng.train_step(batch, NanLoss(), mini_batches=1)
        assert skipped["optimizer_steps"] == 0 and len(applied) == 3
        assert skipped["lr"] == pytest.approx(LR)  # no step: the rate the next one applies ...
        out = eng.train_step(batch, PolicyObjective(), mini_batches=1)
        assert applied[3] == pytest.approx(LR) and out["lr"] == pytest.approx(applied[3])  # ... as it does
    finally:
        if kind == "fsdp2" and dist.is_initialized():
            dist.destroy_process_group()
