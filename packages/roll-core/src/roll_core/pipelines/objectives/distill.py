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

A teacher narrower than the student (fewer config vocab_size rows, e.g. Qwen2.5-3B's 151936 under Qwen2.5-7B's
152064; collectors.distill accepts it when it covers every id of the tokenizer) has no row for the student's extra
padding ids, which the student samples from its untrained rows, rarely. Such a token (`beyond_teacher`) never
reaches the teacher (its engine refuses ids outside its rows): the teacher reads a placeholder id (0) there, and
that token and every later token of its row are unscored: no distillation advantage, outside the loss mask the
actor trains on (the KL-to-reference and task-reward terms included), the whitening and the distill/* means. The
later tokens too, since the teacher's log-probs there would be of a context it was not shown. They are counted
every step in distill/beyond_teacher_tokens (sampled ids beyond the teacher's rows) and distill/unscored_tokens
(those and the tokens after them), with a warning the first time. Why not a floor (log pi_T = log eps): the
teacher's probability of an id it has no row for is not a number we know; any floor makes that token's advantage an
arbitrary outlier (-coef x (log pi_S - log eps)), and whitening then rescales every other token's advantage by it.
Dropping the tokens leaves the other tokens' advantages exact and biases the gradient only by the left-out terms,
whose weight is the student's probability of sampling a padding id (tiny, and the reason the run may go on).

Metrics: distill/reverse_kl (token mean of student - teacher log-prob over sampled tokens), distill/teacher_logp,
distill/student_logp, distill/<teacher>/reverse_kl and distill/<teacher>/rows per teacher, actor/* as in RL (all
over scored tokens); with a narrower teacher also distill/beyond_teacher_tokens and distill/unscored_tokens.
May assume a single-turn outcome batch in roll_core.protocol's layout with `behaviour_logprobs`.
"""

from __future__ import annotations

import logging
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
#: Metrics of a narrower teacher: sampled ids beyond its rows, and the tokens left unscored for them (per step).
BEYOND_KEY, UNSCORED_KEY = "distill/beyond_teacher_tokens", "distill/unscored_tokens"
#: The id a teacher reads in place of one beyond its rows (any id it has; its log-prob there is never used).
PLACEHOLDER_ID = 0

log = logging.getLogger(__name__)


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


def route(batch: Batch, names: Collection[str]) -> dict[str, list[int]]:
    """The rows of `batch` by the teacher that scores them (`teacher_of` each row's metadata); a RuntimeError when a
    row has none (collectors.distill checks the task's domains before the run: a wiring bug)."""
    routed: dict[str, list[int]] = {}
    for i, meta in enumerate(batch["metadata"] if "metadata" in batch else [{}] * len(batch)):
        name = teacher_of(meta or {}, names)
        if name is None:
            raise RuntimeError(
                f"row {i} (domain {(meta or {}).get('domain')!r}) has no teacher among {sorted(names)}: "
                "set distill.teacher (the default) or route its domain with distill.teachers"
            )
        routed.setdefault(name, []).append(i)
    return routed


def beyond_teacher(
    responses: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Response tokens a teacher cannot score: (beyond, unscored), both (B, R) bool. `beyond`: response tokens
    (`mask` (B, R) nonzero) whose id is at or above their row's teacher's logits' width (`rows` (B,) long); `unscored`:
    each row's response tokens from its first beyond token on (the teacher's log-probs after it would be of a context
    it was not shown)."""
    valid = mask.bool()
    beyond = valid & (responses >= rows.to(responses.device).unsqueeze(-1))
    return beyond, valid & (beyond.cumsum(-1) > 0)


def narrower_teachers(cfg: RLVRConfig) -> dict[str, int]:
    """The logits' width (config vocab_size) of each teacher narrower than the student, by name (collectors.distill
    accepts one that covers the tokenizer); teachers as wide or wider are left out."""
    from roll_core.models import resolve_model_path
    from roll_core.pipelines.collectors.distill import output_rows

    remote = cfg.model.trust_remote_code
    student_path = resolve_model_path(cfg.model.path)
    student = output_rows(student_path, remote)
    out: dict[str, int] = {}
    for name, path in cfg.distill.teacher_paths(cfg.model.path).items():
        path = resolve_model_path(path)
        rows = output_rows(path, remote) if path != student_path and student is not None else None
        if rows is not None and rows < student:  # type: ignore[operator]
            out[name] = rows
    return out


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
        #: Widths of the teachers narrower than the student, by name (their extra ids are left unscored).
        self.teacher_rows = narrower_teachers(cfg)
        self._warned_beyond = False

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
            unscored = self.unscored_tokens(batch, mask, out)
            teacher = batch["teacher_logprobs"] = self.teacher_logprobs(batch, student, out, unscored)
        # the tokens the actor trains on: the response's, less those no teacher could score (module docstring)
        full, mask = mask, mask * (~unscored).to(mask.dtype)

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
        if self.distill.task_reward_weight > 0:  # the reward is the whole response's: estimated over all of it
            inputs = self._advantage_inputs(batch, scores, token_rewards_from_scores(scores, full), full, None)
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
        train = batch.select(*(k for k in batch.keys() if k not in (TEACHER_PROMPTS, TEACHER_PROMPT_MASK)))
        if bool(unscored.any()):  # a copy's mask: the batch's own stays the response's
            train["response_mask"] = mask.to(batch["response_mask"].dtype)
        with out.timer("train_actor"):
            train_metrics = roles.actor_train.train(
                train,
                self.policy_objective,
                mini_batches=roles.mini_batches,
                epochs=algo.ppo_epochs,
                temperature=self.temperature,
                shuffle_seed=shuffle,
            )
        out.update({k if "/" in k else f"actor/{k}": v for k, v in train_metrics.items()})
        out["perf/train_tokens_per_s"] = float(full.sum()) * algo.ppo_epochs / max(out.timers["train_actor"], 1e-9)
        out["perf/response_tokens"] = float(full.sum())

    def unscored_tokens(self, batch: Batch, mask: torch.Tensor, out: StepLog) -> torch.Tensor:
        """(B, R) bool: the response tokens no teacher scores (`beyond_teacher` under each row's teacher's width; all
        False without a narrower teacher). Counted in distill/beyond_teacher_tokens and distill/unscored_tokens
        (with a narrower teacher, every step), with a warning the first time any occur."""
        unscored = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
        if not self.teacher_rows:
            return unscored
        widths = torch.full((len(batch),), torch.iinfo(torch.long).max, dtype=torch.long)
        for name, rows in route(batch, self.roles.teachers).items():
            if name in self.teacher_rows:
                widths[torch.as_tensor(rows)] = self.teacher_rows[name]
        beyond, unscored = beyond_teacher(batch["responses"], mask, widths)
        out[BEYOND_KEY], out[UNSCORED_KEY] = float(beyond.sum()), float(unscored.sum())
        if bool(beyond.any()) and not self._warned_beyond:
            self._warned_beyond = True
            r, t = (int(x) for x in beyond.nonzero()[0])
            log.warning(
                "the student sampled %d token id(s) beyond its teacher's rows (first: id %d, row %d, position %d; "
                "teacher widths %s): padding rows of the student's wider vocabulary, which no teacher can score. "
                "They and the %d later token(s) of their rows are left out of the distillation loss and counted in "
                "%s and %s (warned once)",
                int(beyond.sum()),
                int(batch["responses"][r, t]),
                r,
                t,
                self.teacher_rows,
                int(unscored.sum() - beyond.sum()),
                BEYOND_KEY,
                UNSCORED_KEY,
            )
        return unscored

    def teacher_logprobs(
        self, batch: Batch, student: torch.Tensor, out: StepLog, unscored: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, R) log-probs of the sampled response tokens under each row's teacher (0 where the mask is 0, whatever
        the teacher gave there); each teacher's rows and reverse KL go to `out` (distill/<teacher>/rows,
        distill/<teacher>/reverse_kl). A non-finite log-prob at a response token (NaN, or -inf: the teacher gives
        the student's sample probability 0, an infinite reverse KL) is a FloatingPointError naming the teacher, row
        and position: its advantage would be -inf and the whitened batch NaN. `unscored` (B, R) bool (from
        `unscored_tokens`): tokens the teacher is not asked about: it reads `PLACEHOLDER_ID` there (an id beyond its
        rows would be refused), and they are 0 in the result, as masked ones."""
        names = self.roles.teachers
        routed = route(batch, names)
        mask = batch["response_mask"].float()
        teacher = torch.zeros_like(mask)
        for name, rows in routed.items():
            idx = torch.as_tensor(rows)
            tb = teacher_batch(batch, rows)
            valid = mask[idx].bool()
            if unscored is not None and bool(unscored[idx].any()):
                skip = unscored[idx]
                valid = valid & ~skip
                resp = tb["responses"].masked_fill(skip, PLACEHOLDER_ID)
                ids = tb["input_ids"].clone()
                ids[:, ids.shape[1] - resp.shape[1] :] = resp  # the response is the last R input columns
                tb["responses"], tb["input_ids"] = resp, ids
            logp = names[name].compute_logprobs(tb, self.temperature)["logprobs"]
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
            kl = reverse_kl_per_token(student[idx], teacher[idx], valid.to(mask.dtype))
            out[f"distill/{name}/reverse_kl"] = float(masked_mean(kl, valid))
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
