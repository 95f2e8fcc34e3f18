"""`AlgoConfig`, the `algo` group's schema: advantage estimator, losses, KL, corrections, optimisation schedule.

Contract: registered with the other roll-core schemas (roll_core.config.schema.register_configs); the names an
option accepts come from where they are implemented (`algo_choices`: installed entry points and roll-algos' lists),
checked in `__post_init__` with a message that says how to fix the value. A setting that the chosen built-in
estimator or policy loss never reads (algo.gamma with grpo, algo.ratio_cap with ppo, ...), or that the RL objective
reads only when a part is on that is off (algo.critic_lr without a critic, algo.kl_horizon without a KL target,
algo.kl_in_reward=true with algo.kl_coef=0 outside reinforce_pp's own form, ...), is refused there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from roll_core.config.checks import one_of, positive, positive_or_null

#: Advantage estimators that compare the responses of one prompt with each other (algo.group_size >= 2).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gigpo")
#: Estimators whose own form puts the KL in the reward (the reinforce_pp preset sets algo.kl_in_reward=true):
#: there algo.kl_coef=0 is how that KL is switched off, so kl_in_reward=true with it is not refused, as kl_kind is
#: not. With reinforce_pp_baseline and gae, kl_in_reward=true is a choice of its own and needs algo.kl_coef > 0.
KL_IN_REWARD_FORM = ("reinforce_pp",)


def algo_choices() -> dict[str, tuple[str, ...]]:
    """The names `algo.*` accepts, from where they are implemented (defined once, never copied here).

    Estimators are the installed `roll.algorithms` entry points (roll-core's outcome and trajectory estimators and
    any plugin's); policy losses the installed `roll.losses` entry points as roll-algos' dispatcher reads them
    (roll-algos' own and any plugin's: exactly the names `policy_loss(variant=)` runs); loss aggregations and KL
    kinds are roll-algos' own lists. Strings, not Enums: OmegaConf matches an Enum field by member name, and
    `token-mean` or `seq-mean-token-sum` cannot be one.
    roll_algos is imported here, on first validation, because it imports torch, which composing must not.
    """
    from roll_algos.kl import KL_KINDS
    from roll_algos.losses import AGG_MODES, policy_loss_names
    from roll_core.registry import available

    return {
        "adv_estimator": tuple(available("roll.algorithms")),
        "policy_loss": policy_loss_names(),
        "loss_agg": AGG_MODES,
        "kl_kind": KL_KINDS,
    }


@dataclass
class AlgoConfig:
    """The RL algorithm: advantage estimator, losses, KL, optimisation schedule."""

    # Display name of the preset (grpo, ppo, ...); free text, shown in logs.
    name: str = "grpo"
    # Advantage estimator (a roll.algorithms entry point): grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline
    # | gae (trains a critic) | gigpo, turn_grpo (pipeline=agentic: step-level advantages over environment states).
    adv_estimator: str = "grpo"
    # Samples per prompt (the GRPO group size); group estimators need >= 2.
    group_size: int = 8
    # Actor learning rate (AdamW).
    lr: float = 1e-6
    # Linear warm-up steps of the actor and critic learning rates (optimizer steps).
    warmup_steps: int = 0
    # LR schedule after warm-up: constant | cosine | linear. cosine and linear decay towards 0 over the D = T -
    # warmup_steps optimizer steps after the warm-up (T = pipeline.max_steps x ppo_epochs x mini-batches), as Hugging
    # Face's schedules: the last step still trains (linear: at lr / D); 0 is the rate of the step after it.
    lr_schedule: str = "constant"
    # AdamW weight decay.
    weight_decay: float = 0.0
    # Passes over each rollout batch.
    ppo_epochs: int = 1
    # Samples per optimizer step; 0 means the whole rollout batch is one optimizer step.
    mini_batch_size: int = 0
    # Optimizer steps per rollout batch (an alternative to mini_batch_size that does not depend on the batch
    # size); 0: use mini_batch_size. With one step per batch the PPO ratio is 1 and clipping never acts.
    num_mini_batches: int = 0
    # Global gradient-norm clip; 0 disables.
    max_grad_norm: float = 1.0
    # Policy loss variant: ppo | gspo | cispo | tis | topr | vanilla.
    policy_loss: str = "ppo"
    # Loss aggregation over tokens: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm.
    # Each optimizer step's loss is its mini-batch's: token-mean divides by the mini-batch's valid tokens (all its
    # micro-batches and data-parallel ranks), the seq-mean modes by its rows; the KL loss and the entropy bonus are
    # aggregated the same way.
    loss_agg: str = "token-mean"
    # Lower PPO clip epsilon (ratio >= 1 - clip_low); read by policy_loss ppo, gspo and cispo (tis, topr and vanilla
    # refuse a value other than the default).
    clip_low: float = 0.2
    # Upper PPO clip epsilon; > clip_low is DAPO's clip-higher. Read by ppo, gspo and cispo, as clip_low.
    clip_high: float = 0.2
    # Dual-clip constant c > 1 bounding negative-advantage loss at c*|A| (policy_loss ppo, gspo; cispo, tis, topr
    # and vanilla have no clipped surrogate and refuse it); null disables.
    dual_clip: float | None = None
    # Ratio cap of the tis variant (cispo bounds its weight with clip_low/clip_high instead); the other losses never
    # read it and refuse a value other than the default.
    ratio_cap: float = 2.0
    # KL-to-reference coefficient; 0 disables the reference model entirely.
    kl_coef: float = 0.0
    # KL estimator: k1 | k2 (= mse) | k3 (= low_var_kl) | abs.
    kl_kind: str = "k3"
    # Where KL acts: false adds coef*KL to the loss; true subtracts it from the token reward (needs kl_coef > 0,
    # but with adv_estimator=reinforce_pp, whose preset switches its KL off with kl_coef=0).
    kl_in_reward: bool = False
    # Target KL for the adaptive controller (PPO-style); null keeps kl_coef fixed. It is compared with
    # actor/kl_to_ref, the token-weighted mean over the batch's response tokens (verl and OpenRLHF average each
    # sequence first: with responses of varied lengths the same target reads a little differently).
    kl_target: float | None = None
    # Horizon (samples) of the adaptive KL controller.
    kl_horizon: int = 10000
    # Entropy bonus coefficient (subtracted from the loss).
    entropy_coef: float = 0.0
    # Discount of the returns: read by adv_estimator reinforce_pp (not on agentic trajectories), reinforce_pp_baseline,
    # gae, gigpo and turn_grpo; grpo, dr_grpo and rloo never discount and refuse a gamma < 1.
    gamma: float = 1.0
    # GAE lambda: read by adv_estimator=gae only (the other built-in estimators refuse a lam < 1).
    lam: float = 1.0
    # Critic learning rate (gae only).
    critic_lr: float = 1e-5
    # PPO value clip; null disables.
    value_clip: float | None = 0.2
    # Critics of the gae estimator; > 1 is AsyPPO's ensemble of mini-critics (algo=asyppo): critic m trains on its
    # own share of every prompt's responses (group_size / num_critics each, dealt round-robin) and GAE uses the
    # critics' mean value.
    num_critics: int = 1
    # The critics' model (HF folder, hub id, builtin:<name>); null: the policy's model. It reads the policy's token
    # ids, so it must share the policy's tokenizer (AsyPPO: a smaller model of the policy's family).
    critic_model_path: str | None = None
    # AsyPPO advantage masking: the share of a batch's response tokens where the critics agree most (lowest std of
    # their values) whose advantage is set to 0; needs num_critics >= 2. 0 disables.
    critic_agree_fraction: float = 0.0
    # AsyPPO entropy filtering: the share of a batch's response tokens where the critics disagree most (highest std)
    # left out of the entropy bonus; needs num_critics >= 2 and entropy_coef > 0. 0 disables.
    critic_disagree_fraction: float = 0.0
    # Whiten advantages over the batch after estimation (masked: each token counts once, so longer responses weigh
    # more). With a group estimator this re-centres on the batch's token mean: a group whose rewards were all equal
    # (advantage 0) then gets -mean / std, whatever its rewards (norm_std_type=batch scales without re-centring).
    whiten_advantages: bool = False
    # Clip advantages to [-x, x]; null disables.
    advantage_clip: float | None = None
    # Clip sequence rewards to [-x, x]; null disables.
    reward_clip: float | None = None
    # Correction for the gap between the inference engine's log-probs and the trainer's, r = pi_old / pi_behaviour:
    # null | token | sequence (truncated IS: weights min(r, off_policy_cap)) | token_mask | sequence_mask (masked IS:
    # drop tokens / whole sequences whose ratio leaves [correction_low, correction_high]) | icepop (IcePop: weight r
    # inside the band, 0 outside) | geo_mask (drop sequences whose geometric-mean ratio leaves the band).
    off_policy_correction: str | None = None
    # Cap of the truncated IS weights (token, sequence).
    off_policy_cap: float = 2.0
    # Lower end of the band [low, high] of ratios the masking corrections accept; null: the correction's default
    # (token_mask and sequence_mask 0.5, icepop 0.5, geo_mask 0.999). Needs 0 < low <= 1 <= high.
    correction_low: float | None = None
    # Upper end of that band; null: the correction's default (token_mask and sequence_mask 2, icepop 5, geo_mask
    # 1.001).
    correction_high: float | None = None
    # Mean subtracted by the grpo and dr_grpo estimators (ROLL's norm_mean_type): group | batch | none; null: the
    # estimator's own (group). Lite PPO: group.
    norm_mean_type: str | None = None
    # Std the grpo and dr_grpo estimators divide by (ROLL's norm_std_type): group | batch | none; null: the
    # estimator's own (grpo group, dr_grpo none). Lite PPO: batch.
    norm_std_type: str | None = None
    # DAPO soft overlong penalty buffer in tokens (0 disables); the penalty reaches -1 at the response limit.
    overlong_buffer: int = 0
    # DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no GRPO signal) and sample more
    # prompts until the batch holds rollout_batch_size informative groups (or the cap below is reached). The test
    # reads the reward's scores (the task's, with the reward model's): before overlong_buffer's penalty and
    # reward_clip, as DAPO filters on accuracy; a group whose rewards differ only in that penalty is dropped. Needs
    # group_size >= 2 (a group of one never varies).
    drop_uniform_groups: bool = False
    # Dynamic sampling: each refill round samples ceil(missing groups x this factor) prompts.
    refill_oversample: float = 1.5
    # Dynamic sampling cap: at most this many batches' worth of groups sampled per step; then the step trains on
    # the informative groups it has (counted in data/refill_short_groups).
    refill_max_batches: float = 4.0
    # Attention-based credit ("Attention Illuminates LLM Reasoning", arXiv 2510.13554; roll_algos.attention_credit):
    # multiply the advantage of the tokens the actor's own attention marks as critical by attention_credit_gamma:
    # null (off) | preplan (top WAAD of the generating row: a long-range look back produced them) | anchor (top FAI:
    # later tokens attend to them) | coupled (an anchor and the preplan token just before or on it). Costs one
    # no-grad forward of the batch per step; train_engine=hf or fsdp2 (megatron cannot read attention maps).
    attention_credit: str | None = None
    # Factor of a selected token's advantage (> 1 amplifies it, whichever its sign).
    attention_credit_gamma: float = 1.5
    # Fraction of each response's tokens selected as preplan / anchor tokens (rounded up).
    attention_credit_ratio: float = 0.2
    # WAAD's window W: each attention distance counts at most W tokens.
    attention_credit_window: int = 10
    # coupled: an anchor pairs with a preplan token at most this many tokens before it (0: the same token only).
    attention_credit_coupling: int = 1
    # Layers whose attention is read (negative from the top); empty: the middle layer. Each read layer holds
    # logprob_chunk_size x heads x attention_credit_chunk_rows x sequence-length fp32 probabilities while it runs.
    attention_credit_layers: list[int] = field(default_factory=list)
    # Fraction of the read layers' heads averaged for WAAD (the most local by mean attention distance, per row) and
    # for FAI (the most global).
    attention_credit_heads: float = 0.25
    # Query rows per block of attention probabilities (the memory bound above).
    attention_credit_chunk_rows: int = 128

    @property
    def use_critic(self) -> bool:
        """True when the estimator needs a value model."""
        return self.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        """True when a reference model is needed (only when KL is on: a silent default must not switch it on)."""
        return self.kl_coef > 0 or self.kl_target is not None

    def _check_correction(self) -> None:
        from roll_algos.corrections import CORRECTIONS, resolve_bounds

        one_of("algo.off_policy_correction", self.off_policy_correction, (None, "token", "sequence", *CORRECTIONS))
        bounds_set = self.correction_low is not None or self.correction_high is not None
        if self.off_policy_correction in CORRECTIONS:
            try:
                resolve_bounds(self.off_policy_correction, self.correction_low, self.correction_high)
            except ValueError as e:
                raise ValueError(f"algo.correction_low/correction_high: {e}") from None
        elif bounds_set:
            raise ValueError(
                f"algo.correction_low/correction_high bound the masking corrections ({', '.join(CORRECTIONS)}), "
                f"not algo.off_policy_correction={self.off_policy_correction}: set one of those, or leave the bounds "
                "null (truncated IS is capped by algo.off_policy_cap)"
            )

    def _check_attention_credit(self) -> None:
        from roll_algos.attention_credit import STRATEGIES

        one_of("algo.attention_credit", self.attention_credit, (None, *STRATEGIES))
        positive("algo.attention_credit_gamma", self.attention_credit_gamma)
        if not 0 < self.attention_credit_ratio <= 1 or not 0 < self.attention_credit_heads <= 1:
            raise ValueError(
                f"algo.attention_credit_ratio={self.attention_credit_ratio} and attention_credit_heads="
                f"{self.attention_credit_heads} are fractions: they must lie in (0, 1]"
            )
        if (
            self.attention_credit_window < 1
            or self.attention_credit_chunk_rows < 1
            or self.attention_credit_coupling < 0
        ):
            raise ValueError(
                f"algo.attention_credit_window={self.attention_credit_window} and attention_credit_chunk_rows="
                f"{self.attention_credit_chunk_rows} must be >= 1, attention_credit_coupling="
                f"{self.attention_credit_coupling} >= 0"
            )

    def _check_critics(self) -> None:
        if self.num_critics < 1:
            raise ValueError(f"algo.num_critics={self.num_critics} must be >= 1")
        if not self.use_critic and (self.num_critics > 1 or self.critic_model_path is not None):
            raise ValueError(
                f"algo.num_critics / algo.critic_model_path configure the critics of adv_estimator=gae; "
                f"algo.adv_estimator={self.adv_estimator} trains none: leave them at 1 / null"
            )
        if self.num_critics > 1 and self.group_size % self.num_critics:
            raise ValueError(
                f"algo.num_critics={self.num_critics} critics each train on an equal share of every prompt's "
                f"responses: algo.group_size={self.group_size} must be a multiple of num_critics"
            )
        for key in ("critic_agree_fraction", "critic_disagree_fraction"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"algo.{key}={value} must lie in [0, 1)")
            if value > 0 and self.num_critics < 2:
                raise ValueError(
                    f"algo.{key}={value} ranks tokens by the disagreement of several critics: set algo.num_critics "
                    ">= 2 (algo=asyppo), or leave it 0"
                )
        if self.critic_disagree_fraction > 0 and self.entropy_coef == 0:
            raise ValueError(
                f"algo.critic_disagree_fraction={self.critic_disagree_fraction} filters the entropy bonus, which "
                "algo.entropy_coef=0 turns off: set entropy_coef > 0 (algo=asyppo: 0.001), or leave the fraction 0"
            )

    def _check_combinations(self) -> None:
        """Options that another option's value would silently ignore or defeat."""
        from roll_algos.losses import NO_DUAL_CLIP

        if self.dual_clip is not None and self.policy_loss in NO_DUAL_CLIP:
            raise ValueError(
                f"algo.dual_clip={self.dual_clip} bounds the clipped surrogate of policy_loss ppo and gspo; "
                f"algo.policy_loss={self.policy_loss} has none and would ignore it: set algo.dual_clip=null"
            )
        if self.drop_uniform_groups and self.group_size < 2:
            # every group of one is uniform: each step would sample refill_max_batches batches and train on nothing
            raise ValueError(
                f"algo.drop_uniform_groups=true keeps the groups whose rewards differ, and a group of "
                f"algo.group_size={self.group_size} never does: set group_size >= 2, or drop_uniform_groups=false"
            )

    def _check_ignored(self) -> None:
        """Values that the chosen estimator or loss never reads (they would be silently ignored).

        Only roll's own estimators and losses are listed as ignoring a setting: an out-of-tree one may read it. A
        setting with a non-null default (ratio_cap, clip_low, clip_high, critic_lr, value_clip, kl_horizon,
        off_policy_cap) is refused only when set to another value, since every config carries the default.
        """
        from roll_algos.losses import NO_CLIP_RANGE, NO_RATIO_CAP
        from roll_core.algorithms import NO_GAMMA, NO_LAM

        estimator, loss = self.adv_estimator, self.policy_loss
        if self.gamma != 1.0 and estimator in NO_GAMMA:
            raise ValueError(
                f"algo.gamma={self.gamma} discounts the returns of adv_estimator reinforce_pp, reinforce_pp_baseline, "
                f"gae, gigpo and turn_grpo; algo.adv_estimator={estimator} never reads it: set algo.gamma=1"
            )
        if self.lam != 1.0 and estimator in NO_LAM:
            raise ValueError(
                f"algo.lam={self.lam} is the GAE lambda of adv_estimator=gae; algo.adv_estimator={estimator} never "
                "reads it: set algo.lam=1"
            )
        default = {f.name: f.default for f in fields(self)}
        for key in ("clip_low", "clip_high"):
            if getattr(self, key) != default[key] and loss in NO_CLIP_RANGE:
                raise ValueError(
                    f"algo.{key}={getattr(self, key)} bounds the ratio of policy_loss ppo, gspo and cispo; "
                    f"algo.policy_loss={loss} never reads it: set algo.{key}={default[key]} (the default; tis "
                    "caps its weight with algo.ratio_cap)"
                )
        if self.ratio_cap != default["ratio_cap"] and loss in NO_RATIO_CAP:
            raise ValueError(
                f"algo.ratio_cap={self.ratio_cap} caps the weight of policy_loss=tis; algo.policy_loss={loss} never "
                f"reads it: set algo.ratio_cap={default['ratio_cap']} (the default; cispo bounds its weight with "
                "algo.clip_low/clip_high)"
            )
        if estimator in (*NO_LAM, "gae"):  # roll's own estimators: a plugin is handed `algo` and may read any key
            self._check_ignored_by_the_objective(default)

    def _check_ignored_by_the_objective(self, default: dict[str, object]) -> None:
        """Critic, KL and truncated-IS settings that the RL objective reads only when that part is on."""
        if not self.use_critic:  # the critic (its optimizer and value loss) is built for adv_estimator=gae only
            for key in ("critic_lr", "value_clip"):
                if getattr(self, key) != default[key]:
                    raise ValueError(
                        f"algo.{key}={getattr(self, key)} configures the critic of adv_estimator=gae; "
                        f"algo.adv_estimator={self.adv_estimator} trains none and never reads it: set "
                        f"algo.{key}={default[key]} (the default), or algo.adv_estimator=gae (algo=ppo)"
                    )
        # algo.kl_kind is not refused with KL off: algo.kl_coef=0 is how a preset's KL (reinforce_pp's k1) is
        # switched off, and refusing the preset's kind there would make that switch an error.
        if self.kl_in_reward and self.kl_coef == 0 and self.adv_estimator not in KL_IN_REWARD_FORM:
            raise ValueError(
                "algo.kl_in_reward=true subtracts algo.kl_coef x KL from the token rewards, but algo.kl_coef=0 "
                "subtracts nothing (no reference model is even loaded): set algo.kl_coef > 0 (e.g. 0.001) for a KL "
                "penalty in the reward, or algo.kl_in_reward=false (the default)"
            )
        if self.kl_horizon != default["kl_horizon"] and self.kl_target is None:  # a fixed coefficient has no horizon
            raise ValueError(
                f"algo.kl_horizon={self.kl_horizon} is the horizon of the adaptive KL controller; algo.kl_target=null "
                f"keeps algo.kl_coef fixed and nothing reads it: set algo.kl_horizon={default['kl_horizon']} (the "
                "default), or algo.kl_target (with algo.kl_coef > 0)"
            )
        if self.off_policy_cap != default["off_policy_cap"] and self.off_policy_correction not in ("token", "sequence"):
            raise ValueError(
                f"algo.off_policy_cap={self.off_policy_cap} caps the truncated IS weights of off_policy_correction "
                f"token and sequence; algo.off_policy_correction={self.off_policy_correction} never reads it: set "
                f"algo.off_policy_cap={default['off_policy_cap']} (the default; the masking corrections are bounded "
                "by algo.correction_low/correction_high)"
            )

    def _check_normalisation(self) -> None:
        from roll_algos.advantages import NORM_TYPES

        for key in ("norm_mean_type", "norm_std_type"):
            one_of(f"algo.{key}", getattr(self, key), (None, *NORM_TYPES))
        if (self.norm_mean_type or self.norm_std_type) and self.adv_estimator not in ("grpo", "dr_grpo"):
            raise ValueError(
                f"algo.norm_mean_type/norm_std_type choose the reward normalisation of the grpo and dr_grpo "
                f"estimators; algo.adv_estimator={self.adv_estimator} normalises its own way: leave them null"
            )

    def __post_init__(self) -> None:
        for key, allowed in algo_choices().items():
            one_of(f"algo.{key}", getattr(self, key), allowed)
        from roll_algos.schedules import LR_SCHEDULES

        one_of("algo.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        self._check_correction()
        self._check_normalisation()
        self._check_critics()
        self._check_attention_credit()
        if self.group_size < 1:
            raise ValueError(f"algo.group_size={self.group_size} must be >= 1")
        self._check_combinations()
        if self.adv_estimator in GROUP_ESTIMATORS and self.group_size < 2:
            raise ValueError(
                f"algo.adv_estimator={self.adv_estimator} compares samples of one prompt: set algo.group_size >= 2"
            )
        positive("algo.lr", self.lr)
        positive("algo.critic_lr", self.critic_lr)
        positive("algo.warmup_steps", self.warmup_steps, allow_zero=True)
        positive("algo.weight_decay", self.weight_decay, allow_zero=True)
        positive("algo.ratio_cap", self.ratio_cap)
        positive("algo.off_policy_cap", self.off_policy_cap)
        positive("algo.kl_horizon", self.kl_horizon)
        for key in ("value_clip", "advantage_clip", "reward_clip", "kl_target"):
            positive_or_null(f"algo.{key}", getattr(self, key))
        if self.kl_target is not None and self.kl_coef <= 0:  # the controller multiplies: from 0 it stays 0
            raise ValueError(
                f"algo.kl_target={self.kl_target} adapts algo.kl_coef from its value: set algo.kl_coef > 0 (the "
                "starting coefficient, e.g. 0.01), or algo.kl_target=null"
            )
        # `not (x >= 1)`: NaN and the comparison (a NaN or inf oversampling broke the refill's ceil at step 1)
        refill = (self.refill_oversample, self.refill_max_batches)
        if not all(math.isfinite(x) and x >= 1.0 for x in refill):
            raise ValueError(
                f"algo.refill_oversample={self.refill_oversample} and algo.refill_max_batches="
                f"{self.refill_max_batches} must be >= 1 (finite numbers)"
            )
        positive("algo.ppo_epochs", self.ppo_epochs)
        positive("algo.mini_batch_size", self.mini_batch_size, allow_zero=True)
        positive("algo.num_mini_batches", self.num_mini_batches, allow_zero=True)
        if self.mini_batch_size and self.num_mini_batches:
            raise ValueError("set algo.mini_batch_size or algo.num_mini_batches, not both")
        positive("algo.max_grad_norm", self.max_grad_norm, allow_zero=True)
        positive("algo.clip_low", self.clip_low)
        positive("algo.clip_high", self.clip_high)
        if self.clip_low >= 1:
            raise ValueError(f"algo.clip_low={self.clip_low} must be < 1 (the ratio floor is 1 - clip_low)")
        if self.dual_clip is not None and not (math.isfinite(self.dual_clip) and self.dual_clip > 1):
            raise ValueError(f"algo.dual_clip={self.dual_clip} must be > 1 (a finite number; 3 is usual) or null")
        positive("algo.kl_coef", self.kl_coef, allow_zero=True)
        positive("algo.entropy_coef", self.entropy_coef, allow_zero=True)
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"algo.gamma={self.gamma} and algo.lam={self.lam} must lie in [0, 1]")
        positive("algo.overlong_buffer", self.overlong_buffer, allow_zero=True)
        if self.kl_in_reward and self.adv_estimator not in ("reinforce_pp", "reinforce_pp_baseline", "gae"):
            raise ValueError(
                f"algo.kl_in_reward=true needs a token-reward estimator (reinforce_pp, "
                f"reinforce_pp_baseline, gae), not {self.adv_estimator}: use the KL loss instead"
            )
        self._check_ignored()  # after the range checks: an out-of-range value is said as such first
