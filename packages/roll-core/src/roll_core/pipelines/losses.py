"""Loss objects the training engines call per micro-batch: the policy objective and the value objective.

They carry only plain numbers (picklable to Ray workers) and implement the engine's `LossFn` protocol: a call
returning (loss, metrics) aggregated within the micro-batch, and `units(micro)` for exact gradient accumulation
across micro-batches and data-parallel ranks. Metrics aggregated like the loss (`agg`) are weighted by those units
across micro-batches; the masked token means listed in `token_metrics` by their valid tokens (under a sequence mean,
units are rows: a mean of one-row micro-batches' token means was not the batch's token mean).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from roll_algos.kl import kl_estimate
from roll_algos.losses import aggregate, masked_mean, policy_loss, value_loss


def agg_units(mask: Tensor, agg: str) -> float:
    """Aggregation units in a micro-batch: valid tokens (token-mean), rows with tokens, or rows."""
    if agg == "token-mean":
        return float(mask.sum())
    if agg == "seq-mean-token-mean":
        return float((mask.sum(-1) > 0).sum())
    return float(mask.shape[0])


@dataclass
class PolicyObjective:
    """Policy-gradient loss + KL-to-reference loss + entropy bonus (over the tokens of `entropy_mask` (B, R) when the
    micro-batch has one: AsyPPO's filter; `actor/entropy` is always the mean over every response token)."""

    # An installed `roll.losses` name, resolved by `policy_loss` where the call runs: the name pickles to a Ray
    # worker and is looked up there (its entry points are installed too), never a function shipped from the driver.
    variant: str = "ppo"
    agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_cap: float = 2.0
    norm_length: int | None = None
    kl_loss_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    needs_entropy: bool = True
    #: Masked means over the micro-batch's response tokens (the engines weigh them by its valid tokens).
    token_metrics: ClassVar[tuple[str, ...]] = tuple(
        f"actor/{k}"
        for k in (
            "clipfrac_low",
            "clipfrac_high",
            "clipfrac_dual",
            "approx_kl",
            "ratio_mean",
            "entropy",
            "train_infer_logprob_diff",
            "correction/weight_mean",
        )
    )

    def __post_init__(self) -> None:
        if not math.isfinite(self.kl_loss_coef):  # `coef > 0` is False for NaN: the KL term silently disappeared
            raise ValueError(f"kl_loss_coef={self.kl_loss_coef} is not finite (the adaptive KL controller's value?)")

    @property
    def entropy_grad(self) -> bool:
        """Whether the entropy needs its gradient (a bonus); without one it is only logged (actor/entropy), and the
        engines compute it without a graph (two more (b, R, V) fp32 tensors per micro-batch otherwise)."""
        return self.entropy_coef > 0

    def units(self, micro: Mapping[str, Tensor]) -> float:
        return agg_units(micro["response_mask"], self.agg)

    def __call__(self, outputs: dict[str, Tensor], micro: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        logp, mask = outputs["logprobs"], micro["response_mask"]
        # With one optimizer step per batch the rollout policy is the current one: ratio 1, no extra forward.
        old = micro["old_logprobs"] if "old_logprobs" in micro else logp.detach()
        adv = micro["advantages"]
        if "is_weights" in micro:  # off-policy correction; every variant is linear in A, so scaling A is exact
            adv = adv * micro["is_weights"]
        loss, metrics = policy_loss(
            logp,
            old,
            adv,
            mask,
            variant=self.variant,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            agg=self.agg,
            norm_length=self.norm_length,
            ratio_cap=self.ratio_cap,
        )
        out = {f"actor/{k}": v for k, v in metrics.items()}
        out["actor/pg_loss"] = loss.detach()
        if "is_weights" in micro:  # what the correction's weights were where the loss used them (masked: 0)
            out["actor/correction/weight_mean"] = masked_mean(micro["is_weights"], mask)
        if "old_logprobs" not in micro and "behaviour_logprobs" in micro:
            # One optimizer step per batch: these log-probs are the pre-update policy's, so their gap to the
            # engine's is the train/infer mismatch, measured for free (the pipeline measures it otherwise).
            gap = (logp.detach() - micro["behaviour_logprobs"]).abs()
            out["actor/train_infer_logprob_diff"] = masked_mean(gap, mask)
        if self.kl_loss_coef > 0:
            # Masked positions may hold NaN/inf: zeroed first, or k2/mse's gradient (0 * NaN) would be NaN there.
            valid = mask.bool()
            kl = kl_estimate(
                torch.where(valid, logp, 0.0), torch.where(valid, micro["ref_logprobs"].detach(), 0.0), self.kl_kind
            )
            kl_loss = aggregate(kl, mask, self.agg, norm_length=self.norm_length)
            loss = loss + self.kl_loss_coef * kl_loss
            out["actor/kl_loss"] = kl_loss.detach()
        if "entropy" in outputs:
            ent = outputs["entropy"]
            bonus = ent if self.entropy_coef > 0 else ent.detach()
            if "entropy_mask" in micro:  # AsyPPO: tokens left out of the bonus count 0 (the denominator is unchanged)
                bonus = bonus * micro["entropy_mask"]
            ent_agg = aggregate(bonus, mask, self.agg, norm_length=self.norm_length)
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * ent_agg
            out["actor/entropy"] = masked_mean(ent.detach(), mask)
        return loss, out


@dataclass
class ValueObjective:
    """PPO value loss against the GAE returns."""

    clip: float | None = 0.2
    agg: str = "token-mean"
    # Token-sum normaliser of agg=seq-mean-token-sum-norm (the response length limit), as in PolicyObjective.
    norm_length: int | None = None
    needs_entropy: bool = False
    #: Masked means over the response tokens, as PolicyObjective's (`critic/vf_loss` is aggregated like the loss).
    token_metrics: ClassVar[tuple[str, ...]] = ("critic/vf_clipfrac", "critic/abs_error")

    def units(self, micro: Mapping[str, Tensor]) -> float:
        return agg_units(micro["response_mask"], self.agg)

    def __call__(self, outputs: dict[str, Tensor], micro: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        mask = micro["response_mask"]
        loss, m = value_loss(
            outputs["values"],
            micro["values"],
            micro["returns"],
            mask,
            clip=self.clip,
            agg=self.agg,
            norm_length=self.norm_length,
        )
        with torch.no_grad():
            err = masked_mean((outputs["values"] - micro["returns"]).abs(), mask)
        return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": m["vf_clipfrac"], "critic/abs_error": err}
