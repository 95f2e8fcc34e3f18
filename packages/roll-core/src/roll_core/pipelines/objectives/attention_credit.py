"""Attention-based credit in the RL objective (`algo.attention_credit`, arXiv 2510.13554): the actor's train engine
reads its own attention over the batch (one no-grad forward: per-token WAAD and FAI, roll_engines.train._attention)
and the advantages of the strategy's tokens (preplan, anchor or coupled; roll_algos.attention_credit) are multiplied
by `algo.attention_credit_gamma` before the policy loss. Logged: `actor/attention_credit/boosted_fraction` (of the
response tokens) and `actor/attention_credit/weight_mean` (the mean advantage weight over them).

Contract: `apply_attention_credit` returns new advantages (B, R); the batch is not modified. The actor group must
offer `compute_attention_credit` (hf and fsdp2 engines do; Megatron is refused when the config is composed).
"""

from __future__ import annotations

from typing import Any

import torch

from roll_algos.attention_credit import credit_weights
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch


def apply_attention_credit(batch: Batch, adv: torch.Tensor, mask: torch.Tensor, algo: Any, actor: Any, out: StepLog):
    """`adv` (B, R) with the boosted tokens' entries multiplied by algo.attention_credit_gamma (see the module)."""
    with out.timer("attention_credit"):
        scores = actor.compute_attention_credit(
            batch,
            layers=list(algo.attention_credit_layers),
            window=algo.attention_credit_window,
            head_fraction=algo.attention_credit_heads,
            chunk_rows=algo.attention_credit_chunk_rows,
        )
    credit = credit_weights(
        algo.attention_credit,
        scores["waad"],
        scores["fai"],
        mask,
        ratio=algo.attention_credit_ratio,
        gamma=algo.attention_credit_gamma,
        coupling=algo.attention_credit_coupling,
    )
    out.update({f"actor/attention_credit/{k}": float(v) for k, v in credit.stats.items()})
    return adv * credit.weights.to(adv.dtype)
