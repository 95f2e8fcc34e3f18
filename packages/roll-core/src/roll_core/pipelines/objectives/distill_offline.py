"""The offline distillation objective (`roll.objectives` `distill_offline`): the student learns a teacher's top-k.

`update` trains the actor on a batch that carries the teacher's targets, `teacher_topk_ids` (B, R, K) long and
`teacher_topk_logprobs` (B, R, K), aligned with `responses` (the offline distillation collector puts them there:
stored with the rows, or scored by the teacher role). The loss is roll_algos.distill.topk_distill_loss of the
student's log-probs at the teacher's ids (the engine gathers them: `TopKDistillLoss.gather_ids_key`) against the
teacher's, forward or reverse KL (`distill.kind`) with or without the tail bucket (`distill.tail`), token-mean over
`response_mask`. One pass over the batch (`algo` mini-batches), temperature 1 on both sides.

Roles: the actor, and a frozen teacher (`teachers["default"]`) only when `distill.teacher` names one (rows
without stored top-k). Metrics: distill/loss, distill/kl, distill/teacher_topk_mass, distill/student_topk_mass,
distill/tokens, actor/* (lr, grad_norm, nonfinite_steps). Stateless across a resume: the optimizer and the data
position are checkpointed elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from roll_algos.distill import topk_distill_loss
from roll_core.config.schema import RLVRConfig
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.losses import agg_units
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives import RoleNeeds
from roll_core.pipelines.wiring import Roles
from roll_core.posttrain.distill import TEACHER_IDS, TEACHER_LOGPROBS
from roll_core.seeds import Purpose, derive_seed

#: The teacher role's name (build_roles names its group `teacher_<name>`).
TEACHER = "default"
#: Distillation compares the two models' plain distributions (no sampling temperature).
TEMPERATURE = 1.0


#: The loss's token-mean metrics, carried as per-micro-batch sums (suffix _SUM) with their token count (_TOKENS).
_MEANS = ("distill/loss", "distill/kl", "distill/teacher_topk_mass", "distill/student_topk_mass")
_TERMS = ("kl", "teacher_topk_mass", "student_topk_mass")  # topk_distill_loss's names of the last three
_SUM, _TOKENS = "_sum", "distill/micro_tokens"


@dataclass
class TopKDistillLoss:
    """The engine's LossFn: top-k KL of the student (gathered at the micro-batch's teacher ids) to the teacher."""

    kind: str = "forward"
    tail: bool = True
    agg: str = "token-mean"
    #: The engine adds outputs["gathered_logprobs"] (b, R, K): the student's log-probs at these ids.
    gather_ids_key: str = TEACHER_IDS
    needs_entropy: bool = False
    #: Averaged alike over micro-batches by the engines (LossFn): the objective divides the sums by the tokens.
    summed_metrics: ClassVar[tuple[str, ...]] = (_TOKENS, *(f"{k}{_SUM}" for k in _MEANS))

    def units(self, micro: Mapping[str, Tensor]) -> float:
        return agg_units(micro["response_mask"], self.agg)

    def __call__(self, outputs: dict[str, Tensor], micro: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one micro-batch (aggregated with `agg`) and its detached metrics."""
        if "gathered_logprobs" not in outputs:
            raise ValueError(
                f"the train engine gave no gathered_logprobs for {self.gather_ids_key!r}: the micro-batch lacks the "
                "teacher's ids or the engine does not support `gather_ids_key` (every built-in engine does)"
            )
        loss, _, m = topk_distill_loss(
            outputs["gathered_logprobs"],
            micro[TEACHER_LOGPROBS],
            micro["response_mask"],
            kind=self.kind,
            tail=self.tail,
            agg=self.agg,
        )
        # Sums, not means: the engines average metrics over micro-batches, which hold different numbers of tokens;
        # mean(sum) / mean(tokens) is the batch's token-mean (OfflineDistillObjective.update divides).
        tokens = micro["response_mask"].sum().float()
        return loss, {
            _TOKENS: tokens,
            **{f"{k}{_SUM}": v.detach() * tokens for k, v in zip(_MEANS, (loss, *(m[n] for n in _TERMS)), strict=True)},
        }


class OfflineDistillObjective:
    """Trains the actor on the teacher's top-k targets carried by each batch (see the module docstring)."""

    def __init__(self, cfg: RLVRConfig, roles: Roles) -> None:
        if roles.actor_train is None:
            raise ConfigError("pipeline=distill_offline trains the student: the run has no actor_train role")
        self.cfg, self.roles = cfg, roles
        self.loss = TopKDistillLoss(kind=cfg.distill.kind, tail=cfg.distill.tail)

    def update(self, step: int, collected: Collected, out: StepLog) -> None:
        """One pass of `algo` mini-batches over the batch; metrics go to `out`."""
        batch, actor = collected.batch, self.roles.actor_train
        assert actor is not None
        missing = [k for k in (TEACHER_IDS, TEACHER_LOGPROBS) if k not in batch]
        if missing:
            raise ValueError(
                f"step {step}: the batch has no {missing}: the distill_offline objective needs the teacher's top-k "
                "aligned with the responses (pipeline=distill_offline's collector adds them)"
            )
        with out.timer("train_actor"):
            metrics = actor.train(
                batch,
                self.loss,
                mini_batches=self.roles.mini_batches,
                epochs=1,
                temperature=TEMPERATURE,
                shuffle_seed=derive_seed(self.cfg.pipeline.seed, Purpose.SHUFFLE, step),
            )
        micro_tokens = metrics.pop(_TOKENS, 0.0)
        for key in _MEANS:
            total = metrics.pop(key + _SUM, math.nan)
            out[key] = total / micro_tokens if micro_tokens > 0 else math.nan
        out.update({k if "/" in k else f"actor/{k}": v for k, v in metrics.items()})
        tokens = float(batch["response_mask"].sum())
        out["distill/tokens"] = tokens
        out["perf/train_tokens_per_s"] = tokens / max(out.timers["train_actor"], 1e-9)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def check_offline_distill(cfg: RLVRConfig) -> None:
    """Settings offline distillation cannot honour: ConfigError before anything is built (on-policy settings
    changed from their defaults among them, and distill.topk when the rows store their own top-k)."""
    from roll_core.pipelines.objectives.sft import check_algo

    # One pass over each batch of rows, no reference, no entropy bonus, rows without groups: SFT's refusals
    # (algo.ppo_epochs sized the LR schedule for passes never taken; kl/entropy settings were silently unused).
    check_algo(cfg, what="offline distillation")
    d = cfg.distill
    if d.teachers:
        raise ConfigError(
            f"distill.teachers={dict(d.teachers)} routes the student's samples by domain (pipeline=distill); "
            "offline rows get one teacher: set distill.teacher, or store each row's top-k in the data"
        )
    if d.teacher_prompt is not None:
        raise ConfigError(
            "distill.teacher_prompt (context distillation) is on-policy only (pipeline=distill); offline rows are "
            "scored by the teacher on their own prompt"
        )
    # Changed settings this pipeline never reads were accepted and silently ignored (the defaults are accepted:
    # the `distill` node fills every key).
    on_policy = d.changed("coef", "task_reward_weight")
    if on_policy:
        raise ConfigError(
            f"{', '.join(on_policy)}: distill.coef and distill.task_reward_weight weigh on-policy distillation's "
            "advantages (pipeline=distill); pipeline=distill_offline trains the top-k KL alone (no advantages, no "
            "task reward) and ignores them: drop them (distill.kind and distill.tail shape the offline loss), or "
            "use pipeline=distill"
        )
    if d.teacher is None and (topk := d.changed("topk")):
        raise ConfigError(
            f"{topk[0]}: without distill.teacher the rows' stored teacher_topk_ids / teacher_topk_logprobs are "
            "the targets, with their own K, and pipeline=distill_offline ignores distill.topk: drop it, or set "
            "distill.teacher=<model> to compute the top-distill.topk of each row"
        )


class _OfflineDistill:
    """`roll.objectives` `distill_offline`: the actor, and the teacher role when `distill.teacher` is set."""

    def needs(self, cfg: RLVRConfig) -> RoleNeeds:
        check_offline_distill(cfg)
        teachers = {TEACHER: cfg.distill.teacher} if cfg.distill.teacher else {}
        return RoleNeeds(train=True, teachers=teachers)

    def __call__(self, cfg: RLVRConfig, roles: Roles, *, trajectories: bool) -> OfflineDistillObjective:
        return OfflineDistillObjective(cfg, roles)


offline_distill_objective = _OfflineDistill()
