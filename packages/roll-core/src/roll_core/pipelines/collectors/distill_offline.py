"""The offline distillation collector (`pipeline=distill_offline`): rows of `data` with a teacher's top-k targets.

Contract:
- Rows (roll_core.posttrain `load_rows`): without `distill.teacher`, distillation rows that store the teacher's
  top-k (`teacher_topk_ids` / `teacher_topk_logprobs`, one list of K per response token, validated; a file's
  `tokenizer` fingerprint must be the student's). With `distill.teacher`, plain SFT rows (messages,
  prompt/completion, token rows; top-k columns in them are not read) whose targets the teacher role computes:
  the top-`distill.topk` log-probs of each row, once, cached by row across epochs (not checkpointed: a resumed run
  recomputes them from the frozen teacher).
- A step: `pipeline.rollout_batch_size` rows drawn epoch by epoch in a seeded order (the position is checkpointed,
  so a resumed run continues with the rows the uninterrupted run would see; with it the checkpoint holds a
  fingerprint of the tokenised training rows, and resuming onto rows edited in place, same number, is a warning as
  in the RLVR collectors; a checkpoint without one resumes unchecked); `data/epoch` is epochs drawn, fractional;
  `data/skipped_rows` (bad rows of both files) and `data/also_held_out` (training rows whose prompt
  `data.eval_path` holds too, kept) are in every step and in the run summary (`skipped_rows` by reason,
  `also_held_out`), as RLVR reports its task's (roll_core.posttrain.source.PostTrainData);
  the batch is in roll_core.protocol's layout plus `teacher_topk_ids` (B, R, K) long and `teacher_topk_logprobs`
  (B, R, K) float32, 0 where `response_mask` is 0; scores are zeros (nothing is rewarded). `on_policy = False`:
  the engines get the trained weights only before an evaluation.
- Tokenizers: the teacher model's must equal the student's (`tokenizer_fingerprint`), said by `check` before any
  model loads: its ids would index another vocabulary. Teacher ids outside the student's vocabulary (the model
  config's `vocab_size`: stored rows are checked against it when the collector is built, naming the row, besides
  the tokenizer's length when they are read), and teacher top-k not shaped like the rows' responses (B, R,
  K = distill.topk), are an error. A teacher whose config's vocab_size exceeds the student's (vocabulary padding)
  is asked for its top-(K + the difference) and the first K of the student's ids are kept (`student_topk`).
- Evaluation: on the held-out rows (`data.eval_path`, or `data.eval_size` rows of `data.path`), `eval/distill_kl`
  (the training loss's KL, token mean) and `eval/distill_top1_agreement` (the student's most likely token is the
  teacher's, over loss tokens), with no gradient: the actor's `compute_logprobs` cannot gather at given ids, so
  it scores the full vocabulary (`topk=V`) in row chunks of bounded size and the ids are gathered here; plus the
  task's generation accuracy (`eval/accuracy`, as RL reports it) when the run's `env` has held-out problems and
  `distill.eval_task` is true (up to `pipeline.eval_size` problems, the rest counted in `data/unused_held_out` and
  the summary's `unused_held_out`, as RLVR counts them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import nullcontext
from functools import cached_property
from typing import Any

import torch

from roll_algos.distill import topk_distill_loss
from roll_core.config.schema import RLVRConfig
from roll_core.errors import ConfigError
from roll_core.interfaces.tasks import data_metrics
from roll_core.pipelines.collectors import Collected, Collector, CollectorContext
from roll_core.pipelines.collectors._eval_cut import first_eval_size, with_eval_cut
from roll_core.pipelines.collectors.sft import rows_fingerprint, warn_if_other_rows
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.distill_offline import TEACHER, TEMPERATURE, check_offline_distill
from roll_core.posttrain.distill import TEACHER_IDS, TEACHER_LOGPROBS
from roll_core.posttrain.source import PostTrainData, RowSource, load_rows
from roll_core.protocol import Batch

log = logging.getLogger(__name__)

#: What a scoring pass reads (the teacher's and the student's `compute_logprobs`).
SCORE_KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")
#: Rows x response tokens x vocabulary of one full-vocabulary evaluation call (32M: ~400 MB of sorted log-probs
#: and ids, on the worker and back; SmolLM2's 49k vocabulary at 512 response tokens is one row a call).
EVAL_ELEMENTS = 1 << 25


def _tokenizer(path: str, cfg: RLVRConfig) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)


def check_teacher_tokenizer(cfg: RLVRConfig) -> None:
    """The teacher's tokenizer must be the student's: a ConfigError naming both (paths and fingerprints)."""
    from roll_core.models import resolve_model_path
    from roll_core.posttrain.tokenize import tokenizer_fingerprint

    teacher = cfg.distill.teacher
    if teacher is None:
        return
    student = cfg.model.tokenizer or resolve_model_path(cfg.model.path)
    s = tokenizer_fingerprint(_tokenizer(student, cfg))
    t = tokenizer_fingerprint(_tokenizer(resolve_model_path(teacher), cfg))
    if s != t:
        raise ConfigError(
            f"distill.teacher={teacher} has tokenizer {t}, the student ({student}) has {s}: top-k distillation "
            "compares token ids, so the teacher must share the student's tokenizer"
        )


class OfflineDistillCollector:
    """Batches of distillation rows with the teacher's top-k (see the module docstring)."""

    plot_keys: tuple[str, ...] = ("distill/kl", "eval/distill_kl", "eval/accuracy")
    trajectories = False
    on_policy = False
    #: The teacher's logits' width (its config's vocab_size); None: the student's (`vocab`).
    teacher_vocab: int | None = None

    def __init__(self, ctx: CollectorContext) -> None:
        cfg = self.cfg = ctx.cfg
        self.ctx = ctx
        self.teacher = _teacher_group(ctx) if cfg.distill.teacher else None
        kind = "sft" if self.teacher is not None else "distill"
        if self.teacher is not None:
            log.info("distill.teacher=%s computes each row's top-%d targets", cfg.distill.teacher, cfg.distill.topk)
        try:
            self.data: PostTrainData = load_rows(
                kind,
                cfg.data,
                ctx.tokenizer,
                max_prompt_length=cfg.model.max_prompt_length,
                max_response_length=cfg.model.max_response_length,
                seed=cfg.pipeline.seed,
            )
        except ConfigError as exc:
            if kind == "distill" and cfg.data.teacher_ids_key in str(exc):
                raise ConfigError(
                    f"{exc}\nrows without the teacher's top-k need a teacher to compute them: set distill.teacher"
                ) from exc
            raise
        from roll_core.data import PromptSampler

        self.sampler = PromptSampler(
            len(self.data.train), seed=cfg.pipeline.seed, window=cfg.pipeline.rollout_batch_size
        )
        self.vocab = _vocab_size(ctx.model_path, cfg)
        # The teacher's logits' width: a wider one (more vocabulary padding) ranks ids the student has no row for.
        self.teacher_vocab = _vocab_size(_teacher_path(cfg), cfg) if self.teacher is not None else None
        if self.teacher is None:
            for source in (self.data.train, self.data.eval):
                if source is not None:
                    check_stored_ids(source, self.vocab, cfg.model.path, tail=cfg.distill.tail, kind=cfg.distill.kind)
        # Teacher targets by (split, row index): (n, K) int32 ids and float32 log-probs, n = the row's response tokens.
        self.cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.task_eval = _TaskEval(ctx) if cfg.pipeline.eval_every > 0 and cfg.distill.eval_task else None

    # ---- the collector contract ---------------------------------------------------------------------------
    def next(self, step: int, out: StepLog) -> Collected | None:
        """The next `pipeline.rollout_batch_size` rows with their teacher targets."""
        indices = self.sampler.next(self.cfg.pipeline.rollout_batch_size)
        batch = self._batch("train", self.data.train, indices, out)
        out["data/epoch"] = self.sampler.progress()
        out.update(data_metrics(self._data_counts()))  # data/skipped_rows, data/also_held_out, ...
        return Collected(batch, torch.zeros(len(batch)))

    def begin_sync(self) -> None:
        return None

    def finish_sync(self, version: int) -> None:
        return None

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out KL and top-1 agreement (no gradient), and the task's accuracy when it has held-out problems."""
        t0 = time.perf_counter()
        out: dict[str, float] = {}
        if self.data.eval is not None and self.ctx.train is not None:
            out.update(self._eval_kl())
        if self.task_eval is not None:
            out.update(self.task_eval(step))
        out["eval/seconds"] = time.perf_counter() - t0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "data": self._fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])  # (refuses a training set of another size or seed)
        warn_if_other_rows(state, self._fingerprint, len(self.data.train), "rows", log)

    @cached_property
    def _fingerprint(self) -> str:
        return rows_fingerprint(self.data.train)  # the training rows never change within a run

    def summary(self) -> dict[str, Any]:
        """Rows skipped (by reason) or cut when the files were read, training rows also held out (`data_counts`),
        rows with turns of a role roll does not know, by role (`other_roles`: untrained context; SFT rows with
        distill.teacher), rows whose roles were read through another data set's names, by rename (`renamed_roles`,
        "human->user"), and rows the teacher scored; with distill.eval_task, the task's held-out problems beyond
        pipeline.eval_size in `unused_held_out` (`_data_counts`)."""
        return {
            **self._data_counts(),
            "other_roles": self.data.other_roles,
            "renamed_roles": self.data.renamed_roles,
            "truncated_rows": self.data.train.truncated,
            "teacher_scored_rows": len(self.cache),
        }

    def close(self) -> None:
        return None

    def _data_counts(self) -> dict[str, Any]:
        """The data files' counts (`data_counts`) and, in `unused_held_out`, the env task's held-out problems
        beyond pipeline.eval_size (sampled for eval/accuracy, the rest neither trained nor evaluated)."""
        task_eval = getattr(self, "task_eval", None)
        return with_eval_cut(self.data, task_eval.cut if task_eval is not None else 0)

    # ---- batches with teacher targets ---------------------------------------------------------------------
    def _batch(self, split: str, source: RowSource, indices: Sequence[int], out: StepLog | None) -> Batch:
        """Rows `indices` of `source` with `teacher_topk_ids` / `teacher_topk_logprobs` (B, R, K)."""
        batch = source.batch(indices)
        if self.teacher is None:
            return batch  # the rows carry them (validated by roll_core.posttrain.distill)
        todo = sorted({int(i) for i in indices if (split, int(i)) not in self.cache})
        if todo:
            timer = out.timer("teacher") if out is not None else nullcontext()
            with timer:
                self._score(split, source, todo)
        if out is not None:
            out["distill/teacher_scored_rows"] = float(len(todo))
        k = self.cfg.distill.topk
        b, r = batch["responses"].shape
        ids = torch.zeros((b, r, k), dtype=torch.long)
        lps = torch.zeros((b, r, k), dtype=torch.float32)
        for row, i in enumerate(indices):
            t_ids, t_lps = self.cache[(split, int(i))]
            ids[row, : len(t_ids)] = t_ids.long()
            lps[row, : len(t_lps)] = t_lps
        keep = batch["response_mask"].bool()[:, :, None]
        batch[TEACHER_IDS] = torch.where(keep, ids, 0)
        batch[TEACHER_LOGPROBS] = torch.where(keep, lps, 0.0)
        return batch

    def _score(self, split: str, source: RowSource, todo: list[int]) -> None:
        """The teacher's top-k of rows `todo`, into the cache (checked: ids in the student's vocabulary, finite)."""
        assert self.teacher is not None
        rows = source.batch(todo)
        k = self.cfg.distill.topk
        # A teacher with E more rows than the student (vocabulary padding) is asked for its top-(K + E): at most E of
        # them are ids the student lacks, and its top-K among the student's ids are kept (their log-probs still over
        # the teacher's own rows; the dropped ids' mass is in the tail bucket). Asked for K, a padding id among them
        # stopped the run.
        width = self.teacher_vocab or self.vocab
        ask = min(k + max(0, width - self.vocab), width)
        got = self.teacher.compute_logprobs(rows.select(*SCORE_KEYS), TEMPERATURE, topk=ask)
        ids, lps = got["topk_ids"], got["topk_logprobs"].float()
        # (B, R, K) aligned with `responses`: other rows or another width would be cached as targets of the wrong
        # tokens (a short width padded with zeros: id 0 at log-prob 0 under response_mask 1).
        want = (*rows["responses"].shape, ask)
        if tuple(ids.shape) != want or tuple(lps.shape) != want:
            raise ValueError(
                f"distill.teacher returned top-k of shape ids {tuple(ids.shape)}, log-probs {tuple(lps.shape)} for "
                f"rows of responses {tuple(rows['responses'].shape)}: expected {want}, one list of "
                f"distill.topk={k} per response token"
                + (f" (plus {ask - k}: the teacher's rows beyond the student's)" if ask > k else "")
            )
        if ask > k:
            ids, lps = student_topk(ids, lps, self.vocab, k)
        for j, i in enumerate(todo):
            n = len(source.items[i].response_ids)
            row_ids, row_lps = ids[j, :n], lps[j, :n]
            if n and int(row_ids.max()) >= self.vocab:
                raise ValueError(
                    f"distill.teacher ranks token id {int(row_ids.max())} among its top-{self.cfg.distill.topk} at "
                    f"{rows['where'][j]}, outside the student's vocabulary of {self.vocab}"
                )
            if not torch.isfinite(row_lps).all():
                raise FloatingPointError(f"distill.teacher gave a non-finite log-prob at {rows['where'][j]}")
            self.cache[(split, i)] = (row_ids.to(torch.int32), row_lps.clone())

    # ---- evaluation ---------------------------------------------------------------------------------------
    def _eval_kl(self) -> dict[str, float]:
        """KL and top-1 agreement of the student against the teacher on the held-out rows (token means)."""
        assert self.data.eval is not None and self.ctx.train is not None
        source = self.data.eval
        d = self.cfg.distill
        width = max(len(x.response_ids) for x in source.items)
        chunk = max(1, EVAL_ELEMENTS // max(1, width * self.vocab))
        kl_sum = agree = tokens = 0.0
        for s in range(0, len(source), chunk):
            idx = list(range(s, min(s + chunk, len(source))))
            batch = self._batch("eval", source, idx, None)
            got = self.ctx.train.compute_logprobs(batch.select(*SCORE_KEYS), TEMPERATURE, topk=self.vocab)
            # topk=V sorts the whole vocabulary: scatter back to id order, then read the teacher's ids.
            full = torch.empty_like(got["topk_logprobs"]).scatter_(-1, got["topk_ids"], got["topk_logprobs"])
            teacher_ids = batch[TEACHER_IDS]
            student = full.gather(-1, teacher_ids)
            mask = batch["response_mask"].float()
            _, kl, _ = topk_distill_loss(student, batch[TEACHER_LOGPROBS], mask, kind=d.kind, tail=d.tail)
            kl_sum += float(kl.sum())
            # the teacher's most likely stored id: stored top-k lists need not be sorted
            best = teacher_ids.gather(-1, batch[TEACHER_LOGPROBS].argmax(-1, keepdim=True))[..., 0]
            agree += float(((got["topk_ids"][..., 0] == best).float() * mask).sum())
            tokens += float(mask.sum())
        return {
            "eval/distill_kl": kl_sum / max(tokens, 1.0),
            "eval/distill_top1_agreement": agree / max(tokens, 1.0),
            "eval/distill_tokens": tokens,
        }


class _TaskEval:
    """The run task's held-out generation accuracy, as RL reports it (skipped when the task has none)."""

    def __init__(self, ctx: CollectorContext) -> None:
        from roll_core.interfaces.tasks import AgenticTask

        cfg, task = ctx.cfg, ctx.task
        self.ctx = ctx
        self.problems: list[Any] = []
        self.cut = 0  # held-out problems beyond pipeline.eval_size
        if isinstance(task, AgenticTask):
            log.info("env=%s is multi-turn: offline distillation reports no task accuracy", cfg.env.name)
            return
        # Held-out problems beyond pipeline.eval_size: neither trained nor evaluated (the collector's `_data_counts`).
        kept, self.cut = first_eval_size(task.eval_set(), cfg.pipeline.eval_size)
        self.problems = list(kept)
        if not self.problems:
            return
        from roll_core.cluster.roles import RewardGroup
        from roll_core.config.build import as_dict

        self.reward = ctx.cluster.group(
            RewardGroup,
            "reward",
            cfg.pipeline.reward_workers,
            env=as_dict(cfg.env),
            tokenizer_path=cfg.model.tokenizer or ctx.model_path,
            guard=cfg.pipeline.reward_guard(),
            chat_template_kwargs=cfg.model.chat_template_kwargs,  # as the prompts were rendered
        )

    def __call__(self, step: int) -> dict[str, float]:
        if not self.problems:
            return {}
        from roll_core.pipelines.collectors._resume import resuming
        from roll_core.pipelines.rollout import eval_log, evaluate
        from roll_core.seeds import Purpose, derive_seed

        cfg, ctx = self.ctx.cfg, self.ctx
        t = cfg.pipeline.eval_temperature
        params = ctx.sampling.replace(
            temperature=ctx.sampling.temperature if t is None else float(t),
            seed=derive_seed(cfg.pipeline.seed, Purpose.EVAL),
        )
        res = evaluate(
            # an engine's own abort is resumed, as RLVR's evaluation resumes it (not scored an engine failure)
            resuming(ctx.infer, ctx.tokenizer, cfg.pipeline.max_idle_aborts),
            self.reward,
            ctx.tokenizer,
            ctx.task,
            self.problems,
            max_prompt_length=cfg.model.max_prompt_length,
            params=params,
            template_kwargs=cfg.model.chat_template_kwargs,
        )
        return eval_log(res)


def _teacher_group(ctx: CollectorContext) -> Any:
    """The teacher role build_roles built from the objective's RoleNeeds (`teacher_default`)."""
    if TEACHER not in ctx.teachers:
        raise RuntimeError(
            f"distill.teacher={ctx.cfg.distill.teacher} is set but no teacher_{TEACHER} role was built: the "
            "distill_offline objective's RoleNeeds names it"
        )
    return ctx.teachers[TEACHER]


def check_stored_ids(source: RowSource, vocab: int, model: str, tail: bool = True, kind: str = "forward") -> None:
    """A ConfigError naming the first row of `source` whose stored teacher ids reach `vocab`, the model's output
    vocabulary: the rows were checked against the tokenizer (`len(tokenizer)`), which may hold more ids than the
    model's logits have (added tokens without rows in the embedding), and such an id failed inside the engine's
    gather with no row named. Without the tail bucket (`tail=False`) a row storing top-1 lists is refused too: its
    KL is 0 whatever the student (the loss refuses it, but only at the first step, inside the train worker). With
    `kind="reverse"` a -inf teacher log-prob (probability 0) at a loss token is refused: KL(student || teacher) is
    infinite there (the forward KL counts it 0 log 0 = 0) and every step holding the row would be skipped."""
    for item in source.items:
        lps = item.aligned.get(TEACHER_LOGPROBS)
        if kind == "reverse" and lps is not None and lps.numel():
            zero = (lps == float("-inf")).any(-1) & torch.tensor(item.mask[: len(lps)], dtype=torch.bool)
            if bool(zero.any()):
                raise ConfigError(
                    f"{item.where}: teacher_topk_logprobs holds -inf (probability 0) at response position "
                    f"{int(zero.nonzero()[0])}: distill.kind=reverse's KL(student || teacher) is infinite there. "
                    "Use distill.kind=forward (it counts a probability of 0 as 0 log 0 = 0), or drop the row"
                )
        ids = item.aligned.get(TEACHER_IDS)
        if ids is not None and not tail and ids.dim() >= 1 and ids.shape[-1] == 1:
            raise ConfigError(
                f"{item.where}: teacher_topk_ids holds top-1 lists and distill.tail=false: a KL over one id "
                "renormalised on both sides is 0 whatever the student (nothing is learned). Set distill.tail=true "
                "or store the teacher's top-k with K >= 2"
            )
        if ids is not None and ids.numel() and (top := int(ids.max())) >= vocab:
            raise ConfigError(
                f"{item.where}: teacher_topk_ids holds token id {top}, outside the vocabulary of model.path={model} "
                f"(its config's vocab_size={vocab}: the model has no logit for it): the teacher's ids must index the "
                "student model's vocabulary; drop or fix the row"
            )


def student_topk(ids: torch.Tensor, logprobs: torch.Tensor, vocab: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `k` entries of each sorted top-k list (..., K') whose ids are below `vocab` (the student's rows), in
    their order: (ids, log-probs) (..., k). A list with fewer than `k` such ids keeps ids >= `vocab` last (the
    caller's check refuses them)."""
    order = torch.argsort((ids >= vocab).to(torch.int8), dim=-1, stable=True)[..., :k]
    return ids.gather(-1, order), logprobs.gather(-1, order)


def _teacher_path(cfg: RLVRConfig) -> str:
    """The resolved model path of the `default` teacher (distill.teacher)."""
    from roll_core.models import resolve_model_path

    return resolve_model_path(cfg.distill.teacher_paths(cfg.model.path)[TEACHER])


def _vocab_size(model_path: str, cfg: RLVRConfig) -> int:
    """The student model's output vocabulary (its logits' width: ids at or above it cannot be scored)."""
    from transformers import AutoConfig

    mc = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    vocab = getattr(mc, "vocab_size", None) or getattr(getattr(mc, "text_config", None), "vocab_size", None)
    if not vocab:
        raise ConfigError(f"model.path={cfg.model.path}: its config names no vocab_size")
    return int(vocab)


class _OfflineDistill:
    """`pipeline=distill_offline`: rows with a teacher's top-k (stored, or scored by `distill.teacher`)."""

    trajectories = False
    objective = "distill_offline"
    on_policy = False

    def check(self, cfg: RLVRConfig, task: Any) -> None:
        from roll_core.pipelines.collectors import refuse_async, refuse_reward_model

        refuse_async(cfg, "distill_offline", "trains on stored rows and generates nothing while training")
        refuse_reward_model(cfg, "distill_offline", "it trains on a teacher's top-k over the rows of its data files")
        check_offline_distill(cfg)
        if not cfg.data.paths:
            raise ConfigError(
                "pipeline=distill_offline trains on rows of a file: set data.path=<rows.jsonl> (rows with "
                "teacher_topk_ids / teacher_topk_logprobs, or any SFT rows with distill.teacher=<model>)"
            )
        cfg.data.check_installed()
        check_teacher_tokenizer(cfg)

    def __call__(self, ctx: CollectorContext) -> Collector:
        return OfflineDistillCollector(ctx)


offline_distill_collectors = _OfflineDistill()
