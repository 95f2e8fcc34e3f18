"""Schemas of the post-training pipelines beside RL: `sft`, `dpo`, `distill` and `rollout` (top-level nodes of the
run config, each read only by its pipeline; the rows they read are configured by `data`, roll_core.posttrain).

Contract: like roll_core.config.schema, typed dataclasses with defaults (an unknown key fails at composition) whose
`__post_init__` checks each value and says how to fix it. Optimizer settings (lr, warmup, schedule, weight decay,
gradient clipping, mini-batches) stay in `algo`: one place whatever the objective; the `pipeline=<kind>` groups
set values that suit each kind.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _finite_nonneg(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be a finite number >= 0")


@dataclass
class SFTConfig:
    """Supervised fine-tuning (`pipeline=sft`): the negative log-likelihood of the loss-masked response tokens."""

    # How token losses are averaged: token-mean (every target token weighs the same, TRL's default) or per row.
    loss_agg: str = "token-mean"
    # At each evaluation, also the run's `env` task's held-out accuracy by generation (eval/accuracy, as an RL
    # run reports it) when the task has held-out problems; false: only the held-out rows' NLL (eval/sft_loss).
    eval_task: bool = True

    def __post_init__(self) -> None:
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"sft.loss_agg={self.loss_agg!r} is not one of {', '.join(LOSS_AGGS)}")


#: The preference losses of roll_algos.preference (not imported here: config modules stay free of torch).
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "simpo")


@dataclass
class DPOConfig:
    """Preference optimisation (`pipeline=dpo`) on (prompt, chosen, rejected) pairs."""

    # sigmoid (DPO), ipo, hinge (SLiC), simpo (no reference model): roll_algos.preference.
    loss: str = "sigmoid"
    # Strength of the implicit KL to the reference (DPO's beta).
    beta: float = 0.1
    # Conservative DPO: the probability that a pair's preference label is flipped (sigmoid and simpo only).
    label_smoothing: float = 0.0
    # SimPO's target reward margin (gamma); read by loss=simpo only.
    simpo_gamma: float = 0.5
    # Adds this times the chosen responses' token-mean NLL (RPO): keeps the likelihood of chosen answers up.
    sft_weight: float = 0.0
    # Each evaluation also samples the env task's held-out problems (eval/accuracy) beside scoring the held-out
    # pairs (eval/dpo_accuracy, eval/dpo_loss); false: the pairs only (no reward workers are started).
    generate_eval: bool = True

    def __post_init__(self) -> None:
        if self.loss not in DPO_LOSSES:
            raise ValueError(f"dpo.loss={self.loss!r} is not one of {', '.join(DPO_LOSSES)}")
        _finite_nonneg("dpo.beta", self.beta)
        if self.beta == 0:
            raise ValueError("dpo.beta=0 removes the preference signal: 0.1 is usual")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing} must lie in [0, 0.5)")
        if self.label_smoothing and self.loss not in ("sigmoid", "simpo"):
            raise ValueError(f"dpo.label_smoothing applies to loss=sigmoid or simpo, not loss={self.loss}: set it to 0")
        _finite_nonneg("dpo.simpo_gamma", self.simpo_gamma)
        _finite_nonneg("dpo.sft_weight", self.sft_weight)

    @property
    def uses_reference(self) -> bool:
        """SimPO is reference-free; the other losses compare with the reference policy."""
        return self.loss != "simpo"


@dataclass
class DistillConfig:
    """Distillation from one or several teachers: on-policy (`pipeline=distill`: the student samples, teachers
    score its tokens) or offline (`pipeline=distill_offline`: teacher top-k log-probs stored with the rows or
    computed by a teacher role). A setting marked On-policy or Offline is read by that pipeline only: the other
    refuses a value other than its default (it would be ignored)."""

    # The teacher's model (an HF path, a folder or a `model=` preset's path); null: the student's own base model
    # (context distillation: the teacher sees `teacher_prompt`, the student does not).
    teacher: str | None = None
    # Several teachers routed by the row's domain (metadata `domain`): {domain: model path}. Rows of a domain
    # without a teacher go to `teacher` (an error when that is not set either).
    teachers: dict[str, str] = field(default_factory=dict)
    # The teacher's user message, a format string over the row: {prompt} (the student's user message) and the
    # row's metadata fields, e.g. "Worked example:\n{example}\n\n{prompt}" (literal braces doubled: {{ }}); the
    # teacher sees the task's system prompt and worked examples, then this message, chat-templated. Null: the
    # student's prompt. A row whose metadata lacks a named field is skipped and counted.
    teacher_prompt: str | None = None
    # On-policy: each sampled token's advantage is -coef x (student log-prob - teacher log-prob); > 0.
    coef: float = 1.0
    # On-policy: adds this times the task reward's advantage (algo.adv_estimator, group-normalised with grpo)
    # to every token (0: pure distillation).
    task_reward_weight: float = 0.0
    # Offline: forward KL(teacher || student) or reverse KL(student || teacher) on the teacher's top-k ids + tail.
    kind: str = "forward"
    # Offline: top-k ids a teacher role computes for rows that carry none (rows that store their top-k keep their
    # own K: leave it at its default then).
    topk: int = 20
    # Offline: keep the mass outside the top-k as one bucket (false: renormalise over the k ids).
    tail: bool = True
    # Offline: each evaluation also samples the env task's held-out problems (eval/accuracy) beside the held-out
    # rows' KL (eval/distill_kl); false: the rows only (no reward workers are started).
    eval_task: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("forward", "reverse"):
            raise ValueError(f"distill.kind={self.kind!r} is not one of 'forward', 'reverse'")
        if self.topk < 1:
            raise ValueError(f"distill.topk={self.topk} must be >= 1")
        if self.topk == 1 and not self.tail:  # renormalised over one id, both sides are log 1: nothing is learned
            raise ValueError(
                "distill.topk=1 with distill.tail=false gives a loss of 0 whatever the student: raise "
                "distill.topk or set distill.tail=true"
            )
        _finite_nonneg("distill.coef", self.coef)
        if self.coef == 0:
            raise ValueError("distill.coef=0 removes the teacher's signal (for reward-only training use pipeline=rlvr)")
        _finite_nonneg("distill.task_reward_weight", self.task_reward_weight)
        if self.teacher_prompt is not None:
            teacher_prompt_fields(self.teacher_prompt)  # a malformed format string fails here, not at step 1
        for d, path in self.teachers.items():
            if not d or not path:
                raise ValueError(f"distill.teachers: {d!r}: {path!r} needs a domain name and a model path")

    def changed(self, *names: str) -> list[str]:
        """`distill.<name>=<value>` for each of `names` whose value is not the schema's default. A pipeline refuses
        the settings it ignores only when they were changed: the `distill` node fills every key with its default,
        whatever the pipeline."""
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        return [
            f"distill.{n}={str(v).lower() if isinstance(v, bool) else v}"  # as an override writes it
            for n in names
            if (v := getattr(self, n)) != defaults[n]
        ]

    def teacher_paths(self, student: str) -> dict[str, str]:
        """Teacher name -> model path: `default` (`teacher`; the student's model when no teacher is set at all:
        context distillation), and `domain_<d>` per routed domain. With routed teachers and no `teacher` there is
        no default: rows of other domains are an error (roll_core.pipelines.collectors.distill checks the task)."""
        paths = {}
        if self.teacher is not None or not self.teachers:
            paths["default"] = self.teacher or student
        paths.update({f"domain_{d}": p for d, p in self.teachers.items()})
        return paths


def teacher_prompt_fields(template: str) -> list[str]:
    """The field names of a `distill.teacher_prompt` format string (`prompt` and metadata keys), in order.

    Only plain names: attribute or index access ({x.y}, {x[0]}) and conversions would reach into the row's
    values, so they are refused, as are unbalanced braces."""
    import string

    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"distill.teacher_prompt={template!r}: {exc} (write literal braces as {{{{ and }}}})") from exc
    names = []
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conv:
            raise ValueError(
                f"distill.teacher_prompt={template!r}: field {{{name}{'!' + conv if conv else ''}"
                f"{':' + spec if spec else ''}}} must be a plain name such as {{prompt}} or {{example}}"
            )
        names.append(name)
    return names


@dataclass
class RolloutConfig:
    """Rollout-only generation (`pipeline=rollout`): sample and score a task's prompts, write the rows
    (roll_core.pipelines.collectors.rollout_only; the layouts: roll_core.posttrain.writer)."""

    # Where rows go: a .jsonl file or a .parquet folder (one part file per step; roll_core.posttrain.writer).
    # With num_shards > 1 each shard writes its own: rows.jsonl -> rows.shard-<i>-of-<n>.jsonl.
    # Null: <run folder>/rollout.jsonl.
    output: str | None = None
    # Responses per prompt.
    samples_per_prompt: int = 4
    # Prompts to generate for, the first ones of the task's training set (null: every training prompt once).
    # Applied before sharding: the shards of a capped run partition the same prompts.
    max_prompts: int | None = None
    # This job's shard of the prompts (shard i of num_shards takes every num_shards-th prompt from i).
    shard: int = 0
    num_shards: int = 1

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 1:
            raise ValueError(f"rollout.samples_per_prompt={self.samples_per_prompt} must be >= 1")
        if self.num_shards < 1 or not 0 <= self.shard < self.num_shards:
            raise ValueError(f"rollout.shard={self.shard} must lie in [0, rollout.num_shards={self.num_shards})")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"rollout.max_prompts={self.max_prompts} must be >= 1 or null")
        if self.output is not None:
            if not self.output.lower().endswith((".jsonl", ".parquet")):
                raise ValueError(
                    f"rollout.output={self.output!r}: name a .jsonl file or a .parquet folder "
                    "(rows.jsonl, rows.parquet)"
                )

    def output_path(self) -> str | None:
        """`output` as this shard writes it (rows.shard-<i>-of-<n>.jsonl with num_shards > 1); None when unset."""
        if self.output is None or self.num_shards == 1:
            return self.output
        stem, dot, suffix = self.output.rpartition(".")
        return f"{stem}.shard-{self.shard}-of-{self.num_shards}{dot}{suffix}"

    def check_installed(self) -> None:
        """Parquet output needs pyarrow (roll-core[data])."""
        if self.output is not None and self.output.lower().endswith(".parquet"):
            from roll_core.posttrain.config import PYARROW

            PYARROW.require()
