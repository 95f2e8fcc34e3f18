"""The SFT objective (`roll.objectives` `sft`): the negative log-likelihood of the loss-masked response tokens.

`update` trains the actor once over the collected rows (`algo.num_mini_batches` / `algo.mini_batch_size`
optimizer steps, one pass: a batch of file rows is not replayed; passes over the data are `pipeline.max_steps`),
with `roll_algos.sft.sft_loss` over `response_mask` (1 on the trained assistant tokens only: prompts, padding and
masked context inside a multi-turn response never carry loss) at temperature 1 (the model's own distribution).

Metrics: `sft/loss` (token-mean NLL of the batch's trained tokens, each micro-batch under the weights it was
trained with, whatever `sft.loss_agg` is: exact over a rank's micro-batches; data-parallel ranks' means are
averaged), `sft/ppl` (its exp), `sft/tokens` (trained tokens in the batch), and the actor's train metrics under
`actor/` (`actor/nonfinite_steps` drives the run's non-finite stop). The objective holds no state (the data
position is the collector's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from roll_algos.sft import sft_loss
from roll_core.config.schema import RLVRConfig
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.losses import agg_units
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives import RoleNeeds
from roll_core.pipelines.wiring import Roles
from roll_core.seeds import Purpose, derive_seed

#: Metric keys the loss reports per micro-batch (averaged alike by the engines, so their ratio is exact).
_NLL_SUM, _TOKENS = "sft/nll_sum", "sft/micro_tokens"


@dataclass
class SFTLoss:
    """The engines' LossFn for SFT: `sft_loss(outputs["logprobs"], micro["response_mask"], agg)` per micro-batch.

    Plain numbers only (pickles to Ray workers). `units(micro)` makes the sum over micro-batches the mini-batch's
    loss under `agg` (token-mean: every trained token of the mini-batch weighs the same)."""

    agg: str = "token-mean"
    # Token-sum normaliser of agg=seq-mean-token-sum-norm (the response length limit).
    norm_length: int | None = None
    needs_entropy: bool = False
    #: Averaged alike over micro-batches by the engines (LossFn): their ratio is the batch's token mean.
    summed_metrics: ClassVar[tuple[str, ...]] = (_NLL_SUM, _TOKENS)

    def units(self, micro: Mapping[str, Tensor]) -> float:
        return agg_units(micro["response_mask"], self.agg)

    def __call__(self, outputs: dict[str, Tensor], micro: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss, metrics) of one micro-batch; outputs["logprobs"] and micro["response_mask"] are (b, R)."""
        loss, m = sft_loss(outputs["logprobs"], micro["response_mask"], agg=self.agg, norm_length=self.norm_length)
        # Sums, not means: the engines average metrics over micro-batches, so mean(nll_sum) / mean(tokens) is the
        # token-mean NLL of the whole batch (micro-batches hold different numbers of tokens).
        return loss, {_NLL_SUM: m["nll"] * m["tokens"], _TOKENS: m["tokens"]}


class SFTObjective:
    """Supervised fine-tuning update of a batch of rows (see the module docstring)."""

    def __init__(self, cfg: RLVRConfig, roles: Roles) -> None:
        self.cfg, self.roles = cfg, roles
        self.loss = SFTLoss(agg=cfg.sft.loss_agg, norm_length=cfg.model.max_response_length)

    def update(self, step: int, collected: Collected, out: StepLog) -> None:
        """One pass of the actor over `collected.batch` (rows in roll_core.protocol's layout); metrics to `out`."""
        batch, roles = collected.batch, self.roles
        assert roles.actor_train is not None
        mask = batch["response_mask"]
        with out.timer("train_actor"):
            metrics = roles.actor_train.train(
                batch,
                self.loss,
                mini_batches=roles.mini_batches,
                epochs=1,
                temperature=1.0,
                shuffle_seed=derive_seed(self.cfg.pipeline.seed, Purpose.SHUFFLE, step),
            )
        nll_sum, tokens = metrics.pop(_NLL_SUM, math.nan), metrics.pop(_TOKENS, 0.0)
        nll = nll_sum / tokens if tokens > 0 else math.nan
        out["sft/loss"] = nll
        out["sft/ppl"] = math.exp(min(nll, 80.0)) if math.isfinite(nll) else math.nan
        out["sft/tokens"] = float(mask.sum())
        out.update({k if "/" in k else f"actor/{k}": v for k, v in metrics.items()})
        out["perf/train_tokens_per_s"] = float(mask.sum()) / max(out.timers["train_actor"], 1e-9)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def check_algo(cfg: RLVRConfig, what: str = "SFT") -> None:
    """ConfigError for `algo` settings SFT (or another row-batch objective, `what`: offline distillation) cannot
    honour: they would be silently ignored otherwise, and algo.ppo_epochs would size the LR schedule for passes
    never taken."""
    algo, rows = cfg.algo, cfg.pipeline.rollout_batch_size
    if algo.ppo_epochs != 1:
        raise ConfigError(
            f"algo.ppo_epochs={algo.ppo_epochs}: {what} trains each batch of rows once (passes over the data are "
            "pipeline.max_steps x pipeline.rollout_batch_size rows): set algo.ppo_epochs=1"
        )
    if algo.mini_batch_size and algo.group_size != 1:
        # wiring.mini_batches counts rollout_batch_size x group_size rows; a batch of rows has rollout_batch_size.
        raise ConfigError(
            f"algo.mini_batch_size={algo.mini_batch_size} with algo.group_size={algo.group_size}: a {what} batch "
            "holds pipeline.rollout_batch_size rows (no groups): use algo=sft or set algo.group_size=1"
        )
    if algo.num_mini_batches > rows:
        raise ConfigError(
            f"algo.num_mini_batches={algo.num_mini_batches} exceeds the {rows} rows of a {what} batch "
            "(pipeline.rollout_batch_size): lower it"
        )
    if algo.use_reference or algo.entropy_coef:
        raise ConfigError(
            f"algo.kl_coef / algo.kl_target / algo.entropy_coef do not apply to {what} (no reference KL, no entropy "
            "bonus): use algo=sft, or pipeline=distill for a KL to a teacher"
        )


class _SFT:
    """`roll.objectives` `sft`: a trainable actor, nothing else."""

    def needs(self, cfg: RLVRConfig) -> RoleNeeds:
        check_algo(cfg)
        return RoleNeeds(train=True)

    def __call__(self, cfg: RLVRConfig, roles: Roles, *, trajectories: bool) -> SFTObjective:
        return SFTObjective(cfg, roles)


sft_objective = _SFT()
