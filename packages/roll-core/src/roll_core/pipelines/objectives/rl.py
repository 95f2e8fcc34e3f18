"""The RL objective (`roll.objectives` `rl`): GRPO, PPO and the other estimators' update of a scored batch.

`update` runs, top to bottom: reference and old log-probs, values, token rewards (KL in reward), advantages (one
`roll.algorithms` estimator for outcome and trajectory batches), critic and actor updates. Several critics
(algo.num_critics, AsyPPO) are roll_core.pipelines.objectives.critics' ensemble: mean values, per-shard training,
and the masks their disagreement puts on the advantages and the entropy bonus.

May assume the batch has the layout of roll_core.protocol plus `behaviour_logprobs`; a batch generated under
older weights carries `behaviour_version` (B,), and then the proximal log-probs are recomputed (decoupled PPO).
Its state is the KL controller (an adaptive coefficient continues on resume).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from roll_algos import advantages as adv_ops
from roll_algos.corrections import CORRECTIONS, correction_weights, ratio_stats
from roll_algos.kl import AdaptiveKLController, FixedKLController, kl_estimate
from roll_algos.losses import masked_mean, off_policy_weights
from roll_core.algorithms import AdvantageInputs, load_estimator, token_rewards_from_scores
from roll_core.config.schema import RLVRConfig
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.losses import PolicyObjective, ValueObjective
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives import RoleNeeds
from roll_core.pipelines.objectives.critics import Critics
from roll_core.pipelines.wiring import Roles
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

#: Batch keys of trajectory batches that estimators read as turns.
TURN_KEYS = ("turn_rewards", "turn_mask", "turn_ids", "state_keys")

log = logging.getLogger(__name__)


class RLObjective:
    """Policy-gradient update of a scored batch (see the module docstring)."""

    def __init__(self, cfg: RLVRConfig, roles: Roles, *, trajectories: bool) -> None:
        algo = cfg.algo
        self.cfg, self.roles = cfg, roles
        self.estimator = load_estimator(algo.adv_estimator, trajectories=trajectories, gamma=algo.gamma)
        # reinforce_pp's trajectory path reads episode rewards only; with KL off (kl_coef=0: how reinforce_pp's preset
        # switches its KL off) nothing would be dropped
        if trajectories and algo.kl_in_reward and algo.use_reference:
            raise ConfigError(
                "algo.kl_in_reward=true: trajectory batches (pipeline=agentic) score whole episodes, with no per-token "
                "rewards to subtract the KL from (it would be dropped): use the KL loss (algo.kl_in_reward=false "
                "with algo.kl_coef > 0)"
            )
        if trajectories and (algo.norm_mean_type or algo.norm_std_type):
            raise ConfigError(
                "algo.norm_mean_type/norm_std_type normalise outcome batches of consecutive groups (pipeline=rlvr); "
                "trajectory groups are normalised per group by the estimator: leave them null"
            )
        self.kl_ctl = (
            AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
            if algo.kl_target
            else FixedKLController(algo.kl_coef)
        )
        self.policy_objective = PolicyObjective(
            variant=algo.policy_loss,
            agg=algo.loss_agg,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip=algo.dual_clip,
            ratio_cap=algo.ratio_cap,
            norm_length=cfg.model.max_response_length,
            kl_loss_coef=0.0 if algo.kl_in_reward else algo.kl_coef,
            kl_kind=algo.kl_kind,
            entropy_coef=algo.entropy_coef,
        )
        self.value_objective = ValueObjective(
            clip=algo.value_clip, agg=algo.loss_agg, norm_length=cfg.model.max_response_length
        )
        self.temperature = roles.sampling.temperature
        ie = cfg.infer_engine
        self._truncated = bool(getattr(ie, "top_p", 1.0) < 1 or getattr(ie, "top_k", 0) > 0)
        groups = roles.critics or ([roles.critic] if roles.critic is not None else [])
        self.critics = Critics(groups, algo) if groups else None

    def update(self, step: int, collected: Collected, out: StepLog) -> None:
        """Train the policy (and critic) on the batch with its per-row scores (B,); metrics go to `out`."""
        batch, scores = collected.batch, collected.scores
        algo, roles = self.cfg.algo, self.roles
        assert roles.actor_train is not None
        mask = batch["response_mask"].float()
        # 1. reference and old log-probs, values
        self.score_policies(batch, mask, out)
        values = None
        if self.critics is not None:
            with out.timer("values"):
                values = batch["values"] = self.critics.values(batch, mask, out)

        # 2. token rewards (KL in reward), advantages
        token_rewards = token_rewards_from_scores(scores, mask)
        if "ref_logprobs" in batch:
            policy_logp = batch["old_logprobs"] if "old_logprobs" in batch else batch["behaviour_logprobs"]
            valid = mask.bool()  # padding may hold anything (NaN included): estimated on valid tokens only
            kl = (
                kl_estimate(
                    torch.where(valid, policy_logp, 0.0), torch.where(valid, batch["ref_logprobs"], 0.0), algo.kl_kind
                )
                * mask
            )
            out["actor/kl_to_ref"] = float(masked_mean(kl, mask))
            if algo.kl_in_reward:
                token_rewards = token_rewards - self.kl_ctl.value * kl
                out["actor/kl_coef"] = self.kl_ctl.value  # the coefficient this step's rewards were penalised with
            self.kl_ctl.update(out["actor/kl_to_ref"], len(batch))
            if not algo.kl_in_reward:
                out["actor/kl_coef"] = self.kl_ctl.value  # the coefficient of this step's KL loss
            self.policy_objective.kl_loss_coef = 0.0 if algo.kl_in_reward else self.kl_ctl.value
        adv, returns = self.estimator(self._advantage_inputs(batch, scores, token_rewards, mask, values), algo)
        if algo.whiten_advantages:
            adv = adv_ops.whiten(adv, mask)
        if algo.advantage_clip is not None:
            adv = adv.clamp(-algo.advantage_clip, algo.advantage_clip)
        if "advantage_scale" in batch:  # a multi-domain run's per-domain scale, (B,) over each row's tokens
            adv = adv * batch["advantage_scale"].to(adv.dtype).unsqueeze(-1)
        if algo.attention_credit is not None:  # the actor's own attention picks the tokens whose credit is scaled
            from roll_core.pipelines.objectives.attention_credit import apply_attention_credit

            adv = apply_attention_credit(batch, adv, mask, algo, roles.actor_train, out)
        if self.critics is not None:  # AsyPPO: the agreeing critics' tokens lose their advantage
            adv = self.critics.mask_policy_update(batch, adv)
        batch["advantages"] = adv * mask
        out["actor/advantage_abs_mean"] = float(masked_mean(adv.abs(), mask))
        if returns is not None:
            batch["returns"] = returns

        # 3. critic and actor updates (one mini-batch order per step, shared by both)
        shuffle = derive_seed(self.cfg.pipeline.seed, Purpose.SHUFFLE, step)
        epochs, n_mini = algo.ppo_epochs, roles.mini_batches
        if self.critics is not None:
            with out.timer("train_critic"):
                self.critics.train(
                    batch,
                    self.value_objective,
                    out,
                    mini_batches=n_mini,
                    epochs=epochs,
                    temperature=1.0,
                    shuffle_seed=shuffle,
                )
        with out.timer("train_actor"):
            train_metrics = roles.actor_train.train(
                batch,
                self.policy_objective,
                mini_batches=n_mini,
                epochs=epochs,
                temperature=self.temperature,
                shuffle_seed=shuffle,
            )
        out.update({k if "/" in k else f"actor/{k}": v for k, v in train_metrics.items()})
        out["perf/train_tokens_per_s"] = float(mask.sum()) * epochs / max(out.timers["train_actor"], 1e-9)
        # Token counts for FLOP accounting (bench/): generated tokens, and the batch's prompt tokens counted once
        # per group (what a shared-prompt forward needs).
        out["perf/response_tokens"] = float(mask.sum())
        p_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        out["perf/unique_prompt_tokens"] = float(batch["attention_mask"][:, :p_len].sum()) / algo.group_size

    def score_policies(self, batch: Batch, mask: torch.Tensor, out: StepLog) -> None:
        """Adds `ref_logprobs` (B, R) when there is a reference, `old_logprobs` (B, R) when the proximal policy may
        differ from the behaviour one (and their gap to the engine's: its mean and `actor/correction/ratio_*`), and
        `is_weights` (B, R) under an off-policy correction, which scale each token's advantage: truncated IS weights,
        or a roll_algos.corrections mask (its `actor/correction/masked_fraction` ... logged); `mask` (B, R) float is
        the response mask."""
        algo, roles = self.cfg.algo, self.roles
        assert roles.actor_train is not None
        if roles.reference is not None or roles.reference_is_base:
            with out.timer("reference"):
                ref = roles.reference or roles.actor_train
                batch["ref_logprobs"] = ref.compute_logprobs(batch, self.temperature, base=roles.reference_is_base)[
                    "logprobs"
                ]
        if self._need_old_logprobs(batch):
            with out.timer("old_logprobs"):
                batch["old_logprobs"] = roles.actor_train.compute_logprobs(batch, self.temperature)["logprobs"]
            out["actor/train_infer_logprob_diff"] = float(
                masked_mean((batch["old_logprobs"] - batch["behaviour_logprobs"]).abs(), mask)
            )
            # The ratio's distribution every step: what a masking band should be chosen from.
            stats = ratio_stats(batch["old_logprobs"], batch["behaviour_logprobs"], mask)
            out.update({f"actor/correction/{k}": float(v) for k, v in stats.items()})
        if algo.off_policy_correction in CORRECTIONS:
            corr = correction_weights(
                algo.off_policy_correction,
                batch["old_logprobs"],
                batch["behaviour_logprobs"],
                mask,
                low=algo.correction_low,
                high=algo.correction_high,
            )
            batch["is_weights"] = corr.weights
            out.update({f"actor/correction/{k}": float(v) for k, v in corr.stats.items()})
        elif algo.off_policy_correction is not None:
            batch["is_weights"] = off_policy_weights(
                batch["old_logprobs"],
                batch["behaviour_logprobs"],
                mask,
                level=algo.off_policy_correction,
                cap=algo.off_policy_cap,
            )

    def _need_old_logprobs(self, batch: Batch) -> bool:
        """The proximal policy's log-probs are needed whenever the behaviour policy may differ from it."""
        algo = self.cfg.algo
        return (
            algo.ppo_epochs > 1
            or self.roles.mini_batches > 1
            or algo.off_policy_correction is not None
            or (algo.kl_in_reward and "ref_logprobs" in batch)
            # truncated sampling (top-p/top-k): the engine's log-probs are not the trainer's, so actor/kl_to_ref
            # and the adaptive KL controller read the trainer's (they measured KL of the truncated distribution)
            or ("ref_logprobs" in batch and self._truncated)
            or "behaviour_version" in batch  # generated ahead, under older weights (asynchronous collectors)
        )

    @staticmethod
    def _advantage_inputs(
        batch: Batch, scores: torch.Tensor, token_rewards: torch.Tensor, mask: torch.Tensor, values: Any
    ) -> AdvantageInputs:
        if "group_ids" not in batch:  # an outcome batch: consecutive groups of algo.group_size rows
            return AdvantageInputs(scores, token_rewards, mask, values)
        turns = {k: batch[k] for k in TURN_KEYS if k in batch}
        return AdvantageInputs(scores, token_rewards, mask, values, batch["group_ids"], turns)

    def state_dict(self) -> dict[str, Any]:
        kl = self.kl_ctl.state_dict() if hasattr(self.kl_ctl, "state_dict") else {"value": self.kl_ctl.value}
        return {"kl": {**kl, "init": self.cfg.algo.kl_coef}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """An adaptive coefficient continues from the checkpoint's, unless algo.kl_coef was changed on resume (the
        resume check reports it as taking effect: the controller then starts again from it); a fixed one is the
        config's."""
        if not (self.cfg.algo.kl_target and "kl" in state):
            return
        init = state["kl"].get("init", self.cfg.algo.kl_coef)  # (checkpoints before this field: unchanged)
        if init != self.cfg.algo.kl_coef:
            log.info(
                "algo.kl_coef changed on resume (%s -> %s): the adaptive KL controller starts from it",
                init,
                self.cfg.algo.kl_coef,
            )
            return
        self.kl_ctl.load_state_dict(state["kl"])  # (refuses a non-finite saved coefficient)


class _RL:
    """`roll.objectives` `rl`: the actor (and critic, reference) of `algo`."""

    def needs(self, cfg: RLVRConfig) -> RoleNeeds:
        check_critic_shards(cfg)
        return RoleNeeds(train=True, reference=cfg.algo.use_reference, critic=cfg.algo.use_critic)

    def __call__(self, cfg: RLVRConfig, roles: Roles, *, trajectories: bool) -> RLObjective:
        return RLObjective(cfg, roles, trajectories=trajectories)


def check_critic_shards(cfg: RLVRConfig) -> None:
    """ConfigError when AsyPPO's mini-critics would take fewer optimizer steps than their LR schedule plans: each
    trains on its shard (1 / algo.num_critics of the rows) in the actor's mini-batches (wiring.optimizer_schedule
    plans algo.ppo_epochs x mini-batches for every train engine), and a shard with fewer rows than mini-batches
    leaves some empty (no step), so the schedule never reached its end."""
    from roll_core.pipelines.wiring import mini_batches

    algo = cfg.algo
    if not algo.use_critic or algo.num_critics < 2:
        return
    rows = cfg.pipeline.rollout_batch_size * algo.group_size
    shard, n_mini = rows // algo.num_critics, mini_batches(cfg)  # (group_size is a multiple of num_critics)
    if n_mini > shard:
        raise ConfigError(
            f"algo.num_critics={algo.num_critics}: each critic trains on {shard} of the {rows} rows of a step, in "
            f"{n_mini} mini-batches (the actor's): {n_mini - shard} of them would be empty, and the critics' LR "
            f"schedule, planned for {n_mini} optimizer steps per epoch, would never reach its end: use at most "
            f"algo.num_mini_batches={shard}, or algo.mini_batch_size >= {algo.num_critics}"
        )


rl_objective = _RL()
