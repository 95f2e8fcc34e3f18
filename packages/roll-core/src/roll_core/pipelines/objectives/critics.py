"""The critics of the RL objective: PPO's one value model, or AsyPPO's ensemble of mini-critics.

`Critics` wraps the run's critic worker groups (roll_core.pipelines.wiring.Roles.critics):
- `values(batch, mask, out)`: GAE's values (B, R). One critic: its values. Several (algo.num_critics, AsyPPO):
  their mean; the per-token std across critics ranks the tokens for the two masks (roll_algos.asyppo), logged as
  `critic/ensemble_std_mean`, `critic/advantage_masked_fraction`, `critic/entropy_masked_fraction`.
- `mask_policy_update(batch, adv, out)`: advantages (B, R) with the agreement mask applied
  (algo.critic_agree_fraction), and `batch["entropy_mask"]` (B, R) set for the policy loss's entropy bonus
  (algo.critic_disagree_fraction; roll_core.pipelines.losses.PolicyObjective reads it).
- `train(batch, loss, out, ...)`: one critic trains on the whole batch; critic m of several trains on its own
  shard (roll_algos.asyppo.critic_shards: the j-th response of every prompt group goes to critic j % M), with its
  own values as the clip reference.

Metrics. Before the update, over the batch's response tokens, with the values GAE used (the ensemble's mean for
several critics; `value_fit_metrics`): `critic/values_mean`, `critic/returns_mean` and `critic/explained_variance`
= 1 - Var(returns - values) / Var(returns) (verl's `critic/vf_explained_var`, without its epsilon: 1 is a perfect
fit, 0 no better than the returns' mean, below 0 worse). It is absent on a step whose returns are all equal (every
response scored alike under gamma = lambda = 1): equal up to `RETURNS_RTOL` x the largest |return| or |value|, as
GAE's float32 returns (advantages + values) are; and NaN when a value or return is not finite.
The update's metrics: one critic's (its loss's and its engine's: `vf_loss`, `grad_norm`, `lr`, `optimizer_steps`,
...) go under `critic/`. Several critics: critic m's go under `critic_<m>/` (with `rows`, its shard's size), and
every one of them also gets a `critic/` aggregate (`merge_critic_metrics`), so PPO's and AsyPPO's dashboards carry
the same `critic/` keys: counts, times and sizes (`SUMMED`: `optimizer_steps`, `nonfinite_steps`, `train_seconds`,
`rows`, ...) add up over the critics; `grad_norm` and `lr` are means over all the optimizer steps the critics took
(each critic weighted by its `optimizer_steps`, as one engine's are over its own steps; `lr` is the common value
when every critic reports the same); a maximum (`*_max`) is the largest; any other metric (the loss metrics
`vf_loss`, `vf_clipfrac`, `abs_error`) is the mean over the critics that report it.

May assume `values` ran on the batch before the other two (one RL step). Holds no state across steps.
"""

from __future__ import annotations

from typing import Any

import torch

from roll_algos import asyppo
from roll_core.config.schema import AlgoConfig
from roll_core.interfaces.training import is_max_metric, largest
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch

#: Critic metrics that add up over the critics of an ensemble (counts, times, sizes): the ensemble's total.
SUMMED = (
    "optimizer_steps",
    "nonfinite_steps",
    "empty_mini_batches",
    "scaler_skipped_steps",
    "train_seconds",
    "forward_tokens",
    "micro_batches",
    "optimizer_state_mb",
    "rows",
)
#: Critic metrics that are means over the optimizer steps taken (weighted by each critic's `optimizer_steps`).
PER_STEP = ("grad_norm", "lr")
#: Returns whose std is at most this x the largest |return| or |value| count as equal (no explained variance).
#: GAE computes them as advantages + values in float32: a step whose responses all scored alike left them ~1e-8 x
#: the values' scale apart, and 1 - Var(returns - values) / Var(returns) was about -1e14.
RETURNS_RTOL = 1e-4


def value_fit_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`values_mean`, `returns_mean` and `explained_variance` over the tokens where `mask` (B, R) is set, of the
    values and returns (B, R) (see the module docstring); {} without such a token. Padding never contributes."""
    valid = mask.bool()
    if not bool(valid.any()):
        return {}
    v, r = values[valid].double(), returns[valid].double()
    out = {"values_mean": float(v.mean()), "returns_mean": float(r.mean())}
    if not bool(torch.isfinite(v).all() and torch.isfinite(r).all()):
        out["explained_variance"] = float("nan")
    else:
        var = r.var(unbiased=False)
        scale = max(float(r.abs().max()), float(v.abs().max()))
        if float(var) > (RETURNS_RTOL * scale) ** 2:  # (exactly equal returns: 0 > 0 is false, no 0/0)
            out["explained_variance"] = float(1.0 - (r - v).var(unbiased=False) / var)
    return out


def merge_critic_metrics(per_critic: list[dict[str, float]]) -> dict[str, float]:
    """The ensemble's metric of each name any critic of `per_critic` reports (names without a prefix), by the rules
    of the module docstring."""
    out: dict[str, float] = {}
    for name in dict.fromkeys(k for d in per_critic for k in d):
        got = [d for d in per_critic if name in d]
        vals = [d[name] for d in got]
        if name in SUMMED:
            out[name] = sum(vals)
        elif is_max_metric(name):
            out[name] = largest(vals)
        elif name in PER_STEP:
            steps = [float(d.get("optimizer_steps", 1.0)) for d in got]
            if name == "lr" and all(v == vals[0] for v in vals):
                out[name] = vals[0]  # one schedule: its value exactly, not a weighted mean's rounding of it
            elif sum(steps) > 0:
                out[name] = sum(v * w for v, w in zip(vals, steps, strict=True)) / sum(steps)
            else:  # no critic took a step: the rate the next steps apply (a norm is then absent from every critic)
                out[name] = sum(vals) / len(vals)
        else:
            out[name] = sum(vals) / len(vals)
    return out


class Critics:
    """The run's critics (see the module docstring)."""

    def __init__(self, groups: list[Any], algo: AlgoConfig) -> None:
        self.groups, self.algo = groups, algo
        self._per_critic: torch.Tensor | None = None  # (M, B, R) values of the step, several critics only
        self._masks: asyppo.AsyPPOMasks | None = None

    def values(self, batch: Batch, mask: torch.Tensor, out: StepLog) -> torch.Tensor:
        """GAE's values (B, R): the critic's, or the ensemble's mean."""
        if len(self.groups) == 1:
            return self.groups[0].compute_values(batch)["values"]
        self._per_critic = torch.stack([g.compute_values(batch)["values"] for g in self.groups])
        self._masks = asyppo.asyppo_masks(
            self._per_critic,
            mask,
            agree_fraction=self.algo.critic_agree_fraction,
            disagree_fraction=self.algo.critic_disagree_fraction,
        )
        out.update({f"critic/{k}": v for k, v in self._masks.stats.items()})
        return self._masks.values

    def mask_policy_update(self, batch: Batch, adv: torch.Tensor) -> torch.Tensor:
        """Advantages without the agreeing tokens' (B, R); sets batch["entropy_mask"] when entropy is filtered."""
        if self._masks is None:
            return adv
        if self.algo.critic_disagree_fraction > 0:
            batch["entropy_mask"] = self._masks.entropy_mask
        if self.algo.critic_agree_fraction > 0:
            return adv * self._masks.advantage_mask
        return adv

    def shards(self, batch: Batch) -> torch.Tensor:
        """(B,) the critic that trains on each row."""
        n = len(batch)
        groups = batch["group_ids"] if "group_ids" in batch else torch.arange(n) // self.algo.group_size
        return asyppo.critic_shards(torch.as_tensor(groups), len(self.groups))

    def train(self, batch: Batch, loss: Any, out: StepLog, **train_kwargs: Any) -> None:
        """Train every critic (one: the batch; several: each its shard) and log their metrics (module docstring)."""
        if "values" in batch and "returns" in batch:  # the fit of the values GAE used, before they change
            fit = value_fit_metrics(batch["values"], batch["returns"], batch["response_mask"])
            out.update({f"critic/{k}": v for k, v in fit.items()})
        if len(self.groups) == 1:  # its engine's own metrics (grad_norm, lr, ...) under critic/, as the actor's
            metrics = self.groups[0].train(batch, loss, **train_kwargs)
            out.update({k if "/" in k else f"critic/{k}": v for k, v in metrics.items()})
            return
        assert self._per_critic is not None, "values() runs before train() in a step"
        shard = self.shards(batch)
        per_critic: list[dict[str, float]] = []
        for m, group in enumerate(self.groups):
            rows = (shard == m).nonzero().flatten()
            part = batch.index(rows)
            part["values"] = self._per_critic[m][rows]  # its own old values: the value clip's reference
            metrics = group.train(part, loss, **train_kwargs)
            metrics["rows"] = float(len(rows))
            named = {k.split("/", 1)[-1]: v for k, v in metrics.items()}  # critic/vf_loss and grad_norm alike
            out.update({f"critic_{m}/{name}": v for name, v in named.items()})
            per_critic.append(named)
        out.update({f"critic/{name}": v for name, v in merge_critic_metrics(per_critic).items()})
