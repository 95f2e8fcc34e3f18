"""The on-policy distillation objective (`roll.objectives` `distill`, `pipeline=distill`): the student samples, a
frozen teacher scores exactly the sampled tokens, and a policy-gradient step lowers the reverse KL to the teacher.

Per token t of a sampled response: A_t = -distill.coef x (log pi_S(y_t) - log pi_T(y_t)) (roll_algos.distill
`on_policy_distill_advantages`; pi_S is the policy that the ratio compares with: the old log-probs when they are
recomputed, else the engine's behaviour log-probs; under truncated sampling, infer_engine.top_p < 1 or top_k > 0,
they are always recomputed: the engine's are the truncated distribution's, renormalised over the kept tokens,
while the teacher's are the full softmax's, so each log-ratio carried an extra -log(kept mass)), plus
distill.task_reward_weight x the task reward's advantage (algo.adv_estimator over the groups, broadcast over the
response). The loss is the RL policy loss on these advantages (roll_core.pipelines.losses.PolicyObjective:
clipped, importance-weighted, with the KL-to-reference loss when algo.kl_coef > 0), run like the RL objective
(mini-batches, epochs, whitening, advantage clipping, the per-domain advantage scale).

Teachers: `Roles.teachers` by name (RoleNeeds from `distill.teacher_paths`): a row goes to `domain_<d>` when its
`metadata["domain"]` is d and that teacher exists, else to `default`; each teacher scores only its rows. A teacher
scores the batch's responses after its own prompt when the collector put one there (`teacher_prompts`,
`teacher_prompt_mask`: (B, Pt) left-padded, roll_core.pipelines.collectors.distill), else after the student's.
Teacher log-probs use the rollout temperature, as the student's do: both sides of the KL are the same tempered
family. Vocabularies align by token id (the teacher's tokenizer must be the student's: collectors.distill); the
logits' widths may differ (vocabulary padding), each side normalised over its own logits, so a teacher's padding
rows hold part of its mass (none when their logits are -inf). A non-finite teacher log-prob at a response token is
an error (`teacher_logprobs`).

Metrics: distill/reverse_kl (token mean of student - teacher log-prob over sampled tokens), distill/teacher_logp,
distill/student_logp, distill/<teacher>/reverse_kl and distill/<teacher>/rows per teacher, actor/* as in RL.
May assume a single-turn outcome batch in roll_core.protocol's layout with `behaviour_logprobs`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from roll_algos import advantages as adv_ops
from roll_algos.distill import on_policy_distill_advantages, reverse_kl_per_token
from roll_algos.kl import kl_estimate
from roll_algos.losses import masked_mean
from roll_core.algorithms import token_rewards_from_scores
from roll_core.config.schema import RLVRConfig
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives import RoleNeeds
from roll_core.pipelines.objectives.rl import RLObjective
from roll_core.pipelines.wiring import Roles
from roll_core.protocol import Batch, build_sequences
from roll_core.seeds import Purpose, derive_seed

#: Batch tensors of the teacher's own prompt (B, Pt), left-padded, and its attention mask (written by the collector).
TEACHER_PROMPTS, TEACHER_PROMPT_MASK = "teacher_prompts", "teacher_prompt_mask"
DEFAULT_TEACHER = "default"


def teacher_of(metadata: Mapping[str, Any], names: Collection[str]) -> str | None:
    """The teacher that scores a row: `domain_<d>` for the row's domain d when there is one, else `default`;
    None when neither exists."""
    domain = metadata.get("domain")
    if domain is not None and f"domain_{domain}" in names:
        return f"domain_{domain}"
    return DEFAULT_TEACHER if DEFAULT_TEACHER in names else None


def teacher_batch(batch: Batch, rows: list[int]) -> Batch:
    """The rows `rows` of `batch` as a teacher sees them: its own prompt (the `teacher_prompts` columns, trimmed to
    the longest of these rows) or the student's, followed by the same response tokens. Tensors: input_ids,
    attention_mask, position_ids (b, Pt+R), responses, response_mask (b, R); fields problem_id, metadata (for
    inspection) and the structured-output constraint when the batch carries one."""
    from roll_core.interfaces.inference import STRUCTURED_KEY

    sub = batch.index(rows)
    if TEACHER_PROMPTS in sub:
        ids, pmask = sub[TEACHER_PROMPTS], sub[TEACHER_PROMPT_MASK]
        width = int(pmask.sum(-1).max()) if len(rows) else 0
        seq = build_sequences(ids[:, ids.shape[1] - width :], pmask[:, ids.shape[1] - width :], sub["responses"],
                              sub["response_mask"])  # fmt: skip
    else:
        seq = {k: sub[k] for k in ("input_ids", "attention_mask", "position_ids")}
    tensors = {**seq, "responses": sub["responses"], "response_mask": sub["response_mask"]}
    fields = {k: sub[k] for k in ("problem_id", "metadata", STRUCTURED_KEY) if k in sub}
    return Batch(tensors, fields)


class DistillObjective(RLObjective):
    """Reverse-KL policy gradient toward the teachers (see the module docstring). The RL objective's machinery
    (old log-probs, off-policy weights, the reference KL controller, its state) is inherited; the advantages are
    the teachers'."""

    def __init__(self, cfg: RLVRConfig, roles: Roles, *, trajectories: bool) -> None:
        check_algo(cfg)
        if trajectories:
            raise ConfigError("the distill objective scores single-turn batches: use pipeline=distill")
        if not roles.teachers:
            raise ConfigError("pipeline=distill needs a teacher: set distill.teacher or distill.teachers")
        super().__init__(cfg, roles, trajectories=False)
        self.distill = cfg.distill

    def _need_old_logprobs(self, batch: Batch) -> bool:
        """RL's cases, and truncated sampling: the student's side of each log-ratio must be the full softmax's,
        as the teacher's is (the engine's log-probs of a top-p / top-k sample are renormalised over the kept tokens:
        a teacher equal to the student measured a reverse KL of -log(kept mass) per token, and every advantage
        was pushed down by it, most at the student's most uncertain tokens)."""
        return self._truncated or super()._need_old_logprobs(batch)

    def update(self, step: int, collected: Collected, out: StepLog) -> None:
        """Score the batch with its teachers, build the advantages and train the actor; metrics go to `out`."""
        batch, scores = collected.batch, collected.scores
        algo, roles = self.cfg.algo, self.roles
        assert roles.actor_train is not None
        mask = batch["response_mask"].float()
        # 1. the student's log-probs (behaviour, or recomputed old ones), the reference's, the teachers'
        self.score_policies(batch, mask, out)
        student = batch["old_logprobs"] if "old_logprobs" in batch else batch["behaviour_logprobs"]
        with out.timer("teacher"):
            teacher = batch["teacher_logprobs"] = self.teacher_logprobs(batch, student, out)

        # 2. advantages: the teacher's per-token signal, plus the task reward's when weighted in
        adv = on_policy_distill_advantages(student, teacher, mask, coef=self.distill.coef)
        out["distill/reverse_kl"] = float(masked_mean(reverse_kl_per_token(student, teacher, mask), mask))
        out["distill/teacher_logp"] = float(masked_mean(teacher, mask))
        out["distill/student_logp"] = float(masked_mean(student, mask))
        if "ref_logprobs" in batch:
            kl = kl_estimate(student, batch["ref_logprobs"], algo.kl_kind) * mask
            out["actor/kl_to_ref"] = float(masked_mean(kl, mask))
            self.kl_ctl.update(out["actor/kl_to_ref"], len(batch))
            out["actor/kl_coef"] = self.kl_ctl.value
            self.policy_objective.kl_loss_coef = self.kl_ctl.value
        if self.distill.task_reward_weight > 0:
            inputs = self._advantage_inputs(batch, scores, token_rewards_from_scores(scores, mask), mask, None)
            task_adv, _ = self.estimator(inputs, algo)
            out["distill/task_advantage_abs_mean"] = float(masked_mean(task_adv.abs(), mask))
            adv = adv + self.distill.task_reward_weight * task_adv
        if algo.whiten_advantages:
            adv = adv_ops.whiten(adv, mask)
        if algo.advantage_clip is not None:
            adv = adv.clamp(-algo.advantage_clip, algo.advantage_clip)
        if "advantage_scale" in batch:  # a multi-domain run's per-domain scale, (B,) over each row's tokens
            adv = adv * batch["advantage_scale"].to(adv.dtype).unsqueeze(-1)
        batch["advantages"] = adv * mask
        out["actor/advantage_abs_mean"] = float(masked_mean(adv.abs(), mask))

        # 3. the actor's update (one mini-batch order per step, as RL)
        shuffle = derive_seed(self.cfg.pipeline.seed, Purpose.SHUFFLE, step)
        with out.timer("train_actor"):
            train_metrics = roles.actor_train.train(
                batch.select(*(k for k in batch.keys() if k not in (TEACHER_PROMPTS, TEACHER_PROMPT_MASK))),
                self.policy_objective,
                mini_batches=roles.mini_batches,
                epochs=algo.ppo_epochs,
                temperature=self.temperature,
                shuffle_seed=shuffle,
            )
        out.update({k if "/" in k else f"actor/{k}": v for k, v in train_metrics.items()})
        out["perf/train_tokens_per_s"] = float(mask.sum()) * algo.ppo_epochs / max(out.timers["train_actor"], 1e-9)
        out["perf/response_tokens"] = float(mask.sum())

    def teacher_logprobs(self, batch: Batch, student: torch.Tensor, out: StepLog) -> torch.Tensor:
        """(B, R) log-probs of the sampled response tokens under each row's teacher (0 where the mask is 0, whatever
        the teacher gave there); each teacher's rows and reverse KL go to `out` (distill/<teacher>/rows,
        distill/<teacher>/reverse_kl). A non-finite log-prob at a response token (NaN, or -inf: the teacher gives
        the student's sample probability 0, an infinite reverse KL) is a FloatingPointError naming the teacher, row
        and position: its advantage would be -inf and the whitened batch NaN."""
        names = self.roles.teachers
        routed: dict[str, list[int]] = {}
        for i, meta in enumerate(batch["metadata"] if "metadata" in batch else [{}] * len(batch)):
            name = teacher_of(meta or {}, names)
            if name is None:  # collectors.distill checks the task's domains before the run: this is a wiring bug
                raise RuntimeError(
                    f"row {i} (domain {(meta or {}).get('domain')!r}) has no teacher among {sorted(names)}: "
                    "set distill.teacher (the default) or route its domain with distill.teachers"
                )
            routed.setdefault(name, []).append(i)
        mask = batch["response_mask"].float()
        teacher = torch.zeros_like(mask)
        for name, rows in routed.items():
            logp = names[name].compute_logprobs(teacher_batch(batch, rows), self.temperature)["logprobs"]
            idx = torch.as_tensor(rows)
            valid = mask[idx].bool()
            bad = valid & ~torch.isfinite(logp)
            if bad.any():
                r, t = (int(x) for x in bad.nonzero()[0])
                raise FloatingPointError(
                    f"teacher {name} gives log-prob {float(logp[r, t])} to the sampled token of row {rows[r]} at "
                    f"response position {t}: a reverse KL to it is not finite (-inf: the teacher's probability of "
                    "the student's token is 0)"
                )
            teacher[idx] = torch.where(valid, logp.to(teacher.dtype), 0.0)  # x * 0 is NaN for a masked NaN / inf
            out[f"distill/{name}/rows"] = float(len(rows))
            kl = reverse_kl_per_token(student[idx], teacher[idx], mask[idx])
            out[f"distill/{name}/reverse_kl"] = float(masked_mean(kl, mask[idx]))
        return teacher


def check_algo(cfg: RLVRConfig) -> None:
    """Refuse `algo` settings the distillation advantages cannot honour (a ConfigError saying why)."""
    algo = cfg.algo
    if algo.use_critic:
        raise ConfigError(
            f"pipeline=distill: algo.adv_estimator={algo.adv_estimator} trains a critic, but distillation's "
            "advantages are per-token teacher log-ratios: use algo=grpo (the default)"
        )
    if algo.kl_in_reward and algo.use_reference:  # with KL off (kl_coef=0) nothing would be dropped
        raise ConfigError("pipeline=distill: algo.kl_in_reward=true needs token rewards: use the KL loss instead")


class _Distill:
    """`roll.objectives` `distill`: a trainable actor, the teachers of `distill`, a reference when algo.kl_coef."""

    def needs(self, cfg: RLVRConfig) -> RoleNeeds:
        check_algo(cfg)
        return RoleNeeds(
            train=True, reference=cfg.algo.use_reference, teachers=cfg.distill.teacher_paths(cfg.model.path)
        )

    def __call__(self, cfg: RLVRConfig, roles: Roles, *, trajectories: bool) -> DistillObjective:
        return DistillObjective(cfg, roles, trajectories=trajectories)


distill_objective = _Distill()
