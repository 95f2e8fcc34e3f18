"""A step's maxima (`actor/ratio_max`) are the largest value over its micro-batches, mini-batches and data-parallel
ranks, whatever the cut: they were averaged like the means (weighted by each micro-batch's tokens), so one token at
ratio 5 read 5.0 with one micro-batch, 2.54 with three and 2.08 with six."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.cluster.roles import merge_rank_metrics
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_engines.train.hf import HFTrainEngine

RATIO = 5.0


@pytest.fixture(scope="module")
def batch(tiny: str) -> dict[str, torch.Tensor]:
    """The toy batch (6 rows, 1-7 response tokens) whose old log-probs put one token (row 1) at ratio 5 and every
    other at 1 (lr 0: the policy stays the scoring one)."""
    out = toy_batch(tiny)
    logp = HFTrainEngine(tiny, lr=0.0, pack_sequences=False).compute_logprobs(out)["logprobs"]
    old = logp.clone()
    old[1, 2] -= math.log(RATIO)
    return {**out, "old_logprobs": old}


@pytest.mark.parametrize(("micro", "minis"), [(6, 1), (1, 1), (2, 3), (6, 3)])
def test_ratio_max_is_the_steps_largest_ratio_whatever_the_cut(
    tiny: str, batch: dict[str, torch.Tensor], micro: int, minis: int
) -> None:
    eng = HFTrainEngine(tiny, lr=0.0, micro_batch_size=micro, pack_sequences=False)
    m = eng.train_step(batch, PolicyObjective(), mini_batches=minis)
    tokens = float(batch["response_mask"].sum())
    assert m["actor/ratio_max"] == pytest.approx(RATIO, rel=1e-4)
    assert m["actor/ratio_mean"] == pytest.approx((tokens - 1 + RATIO) / tokens, rel=1e-4)  # means stay means


def test_ratio_max_merges_over_ranks_as_the_largest(tiny: str, batch: dict[str, torch.Tensor]) -> None:
    """Rows 0-2 (the ratio-5 token) on one data-parallel rank, rows 3-5 on another: the merged step's ratio_max is
    5, not the ranks' token-weighted mean."""
    per_rank = [
        HFTrainEngine(tiny, lr=0.0, pack_sequences=False).train_step(
            {k: v[rows] for k, v in batch.items()}, PolicyObjective()
        )
        for rows in (slice(0, 3), slice(3, 6))
    ]
    assert [m["actor/ratio_max"] for m in per_rank] == pytest.approx([RATIO, 1.0], rel=1e-4)
    merged = merge_rank_metrics(per_rank, [3, 3])
    assert merged["actor/ratio_max"] == pytest.approx(RATIO, rel=1e-4)
    nan = merge_rank_metrics([{"actor/ratio_max": math.nan}, {"actor/ratio_max": 2.0}], [1, 1])
    assert math.isnan(nan["actor/ratio_max"])  # a blown-up rank is not hidden behind a finite one
