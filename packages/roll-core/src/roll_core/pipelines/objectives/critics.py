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
  own values as the clip reference. Each critic's metrics go under `critic_<m>/`, their mean under `critic/`.

May assume `values` ran on the batch before the other two (one RL step). Holds no state across steps.
"""

from __future__ import annotations

from typing import Any

import torch

from roll_algos import asyppo
from roll_core.config.schema import AlgoConfig
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch


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
        """Train every critic (one: the batch; several: each its shard) and log their metrics."""
        if len(self.groups) == 1:  # its engine's own metrics (grad_norm, lr, ...) under critic/, as the actor's
            metrics = self.groups[0].train(batch, loss, **train_kwargs)
            out.update({k if "/" in k else f"critic/{k}": v for k, v in metrics.items()})
            return
        assert self._per_critic is not None, "values() runs before train() in a step"
        shard = self.shards(batch)
        sums: dict[str, float] = {}
        for m, group in enumerate(self.groups):
            rows = (shard == m).nonzero().flatten()
            part = batch.index(rows)
            part["values"] = self._per_critic[m][rows]  # its own old values: the value clip's reference
            metrics = group.train(part, loss, **train_kwargs)
            metrics["rows"] = float(len(rows))
            for k, v in metrics.items():
                name = k.split("/", 1)[-1]
                out[f"critic_{m}/{name}"] = v
                if k.startswith("critic/"):
                    sums[k] = sums.get(k, 0.0) + v
        out.update({k: v / len(self.groups) for k, v in sums.items()})
