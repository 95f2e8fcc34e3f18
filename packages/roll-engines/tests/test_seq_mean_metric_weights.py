"""Under a sequence-mean loss aggregation (algo.loss_agg=seq-mean-*) a step's token-mean metrics (actor/entropy, the
clip fractions, actor/approx_kl, actor/ratio_mean, actor/train_infer_logprob_diff, the correction weight's mean,
critic/vf_clipfrac, critic/abs_error) are the whole batch's token means whatever the micro-batch cut, and the
sequence-weighted ones (pg_loss, kl_loss, vf_loss) its sequence means. Token means were weighted by each
micro-batch's loss units, rows here: one-row micro-batches reported the mean of the rows' token means (on the toy
batch under seq-mean-token-mean: clipfrac_high 0.264 for 0.154, ratio_mean 1.043 for 0.991, the correction
weight's mean 1.086 for 1.039)."""

from __future__ import annotations

import pytest
import torch

from roll_core.cluster.roles import merge_rank_metrics
from roll_core.pipelines.objectives import PolicyObjective, ValueObjective
from roll_core.testing.batches import critic_batch, toy_batch
from roll_engines.train.hf import HFTrainEngine

AGGS = ["seq-mean-token-mean", "seq-mean-token-sum-norm"]
CUTS = [(1, 1), (2, 3), (5, 2)]  # (micro_batch_size, mini_batches): unequal micro-batches of 1-7 tokens
TOKEN_MEANS = ["clipfrac_low", "clipfrac_high", "approx_kl", "ratio_mean", "entropy", "correction/weight_mean"]


@pytest.fixture(scope="module")
def batch(tiny: str) -> dict[str, torch.Tensor]:
    """The toy batch (6 rows of 1-7 response tokens) with old log-probs off the policy's by up to ~0.5 nat (both
    clip fractions non-zero), correction weights and reference log-probs (lr 0: the policy stays the scoring one)."""
    out = toy_batch(tiny)
    logp = HFTrainEngine(tiny, lr=0.0, pack_sequences=False).compute_logprobs(out)["logprobs"]
    g = torch.Generator().manual_seed(1)
    noise = (torch.rand(logp.shape, generator=g) - 0.5) * 1.0
    return {
        **out,
        "old_logprobs": logp + noise,
        "ref_logprobs": logp - noise.abs(),
        "is_weights": torch.rand(logp.shape, generator=g) + 0.5,
    }


def _policy(agg: str) -> PolicyObjective:
    return PolicyObjective(agg=agg, norm_length=7, kl_loss_coef=0.1)


def _step(tiny: str, batch: dict, objective, micro: int, minis: int, role: str = "actor") -> dict[str, float]:
    eng = HFTrainEngine(tiny, role=role, lr=0.0, micro_batch_size=micro, pack_sequences=False)
    return eng.train_step(batch, objective, mini_batches=minis)


@pytest.mark.parametrize("agg", AGGS)
def test_policy_metrics_are_the_whole_batchs_whatever_the_cut(tiny: str, batch: dict, agg: str) -> None:
    whole = _step(tiny, batch, _policy(agg), 6, 1)  # one micro-batch: the metrics of the batch at once
    assert whole["actor/clipfrac_low"] > 0 and whole["actor/clipfrac_high"] > 0
    for micro, minis in CUTS:
        m = _step(tiny, batch, _policy(agg), micro, minis)
        for k in [*TOKEN_MEANS, "pg_loss", "kl_loss"]:
            assert m[f"actor/{k}"] == pytest.approx(whole[f"actor/{k}"], rel=1e-5, abs=1e-7), (k, micro, minis)


def test_train_infer_gap_and_value_metrics_whatever_the_cut(tiny: str, batch: dict) -> None:
    agg = "seq-mean-token-mean"
    one_step = {k: v for k, v in batch.items() if k not in ("old_logprobs", "is_weights")}
    one_step["behaviour_logprobs"] = batch["old_logprobs"]
    critic = critic_batch(tiny)
    value = ValueObjective(clip=0.05, agg=agg)
    whole = _step(tiny, one_step, _policy(agg), 6, 1)
    whole_v = _step(tiny, critic, value, 6, 1, role="critic")
    assert whole_v["critic/vf_clipfrac"] > 0
    for micro, minis in CUTS:
        m = _step(tiny, one_step, _policy(agg), micro, minis)
        k = "actor/train_infer_logprob_diff"
        assert m[k] == pytest.approx(whole[k], rel=1e-5), (micro, minis)
        mv = _step(tiny, critic, value, micro, minis, role="critic")
        for k in ("critic/vf_clipfrac", "critic/abs_error", "critic/vf_loss"):
            assert mv[k] == pytest.approx(whole_v[k], rel=1e-5, abs=1e-7), (k, micro, minis)


def test_ranks_merge_to_the_whole_batchs_token_means(tiny: str, batch: dict) -> None:
    """Rows 0-1 (10 tokens) on one data-parallel rank, rows 2-5 (16 tokens) on another: the group's merge weighs
    each rank's token mean by its tokens and its sequence mean by its rows."""
    agg = "seq-mean-token-mean"
    whole = _step(tiny, batch, _policy(agg), 6, 1)
    per_rank = [
        _step(tiny, {k: v[rows] for k, v in batch.items()}, _policy(agg), 1, 1) for rows in ([0, 1], [2, 3, 4, 5])
    ]
    merged = merge_rank_metrics(per_rank, [2, 4])
    for k in [*TOKEN_MEANS, "pg_loss", "kl_loss"]:
        assert merged[f"actor/{k}"] == pytest.approx(whole[f"actor/{k}"], rel=1e-5, abs=1e-7), k
