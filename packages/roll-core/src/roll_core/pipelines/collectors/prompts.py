"""The prompts collector (`pipeline=rlvr`, synchronous): sample prompts, generate `group_size` responses each under
the current weights, score them with the task's reward, and shape the scores.

Contract: a step draws `pipeline.rollout_batch_size` prompts from the task's training set (a `PromptSampler`
whose position is checkpointed, so a resumed run draws what the uninterrupted run would; a checkpoint's `pending`
prompts, an asynchronous run's groups not yet trained, are drawn first); prompts longer than
`model.max_prompt_length` are skipped and counted, never truncated; with `algo.drop_uniform_groups` (DAPO dynamic
sampling) groups without reward variance are filtered out and more prompts are drawn, in rounds (data/refill_rounds,
as the asynchronous collector counts them), until the batch is full or `algo.refill_max_batches` batches' worth were
sampled; the step's counts cover every round (data/sampled_groups, data/dropped_groups, the skips, `reward/rows` and
the reward's other counters, `perf/rollout_tokens`: response tokens generated), while the reward and length metrics
describe the first round's unfiltered sample. Scores get the overlong penalty and reward clipping.
Evaluation: one sample per held-out problem at the eval temperature; `eval/n` counts the problems scored, and those
skipped unscored count under the training's names (`eval/skipped_long_prompts`, `eval/skipped_context_prompts`).
Data counts: the task's bad rows skipped at load and training rows left out as held out (DataCounts,
roll_core.interfaces.tasks) are in every trained step's data/skipped_rows and data/also_held_out and in the summary;
held-out rows neither trained on nor evaluated in data/unused_held_out and the summary's `unused_held_out`: the
task's own count plus the held-out problems beyond pipeline.eval_size (evaluation reads the first eval_size).
Aborts: a row the engine aborts on its own (SGLang under memory pressure, vLLM at its preemption limit) is resumed
from its partial output within its token budget, as the asynchronous driver resumes its samples
(`resume_aborted`, counted in data/resumed_rows), never scored as an incomplete answer; a prompt the engine keeps
refusing (`pipeline.max_idle_aborts` aborts in a row without a token: roll_core.idle_aborts) has its whole group
dropped (data/refused_prompts, logged), so every trained group is complete and group-relative advantages keep their
meaning; evaluation resumes and refuses the same way.
Multi-domain tasks (roll_envs.tasks.multi): prompts are mixed by the task's counts or weights
(roll_core.data.DomainSampler), metrics and evaluation are also reported per domain (`domain/<d>/...`,
`eval/<d>/accuracy`; `domain/<d>/trained_share`: the mix trained on, after dynamic sampling's filter), and rows
carry `advantage_scale` (the trainer multiplies their advantages) when a domain's scale is not 1. A reward model
(`reward_model=hf`) scores after the task's reward and adds to or replaces its scores
(roll_core.pipelines.reward_model).
Vision-language models: prompts are encoded with the model's `VisionProcessor` (the problems' pictures placed in
their prompts, roll_core.pipelines.rollout); the batch's `mm_inputs` reach the engines and, without the PIL
pictures (the tensors suffice), the trainer. Problems with pictures and a text model: a ConfigError at start.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from roll_algos.losses import overlong_penalty
from roll_core.cluster.reward_guard import RewardFailureBudget
from roll_core.cluster.roles import RewardGroup
from roll_core.config.build import as_dict
from roll_core.data import check_counts, data_fingerprint, make_sampler
from roll_core.errors import ConfigError
from roll_core.idle_aborts import KEY as IDLE_ABORTS_KEY
from roll_core.idle_aborts import MAX_IDLE_ABORTS  # noqa: F401 (re-exported: callers import it from here)
from roll_core.interfaces.tasks import data_metrics
from roll_core.pipelines.collectors import Collected, CollectorContext
from roll_core.pipelines.collectors._eval_cut import first_eval_size, with_eval_cut
from roll_core.pipelines.collectors._resume import _Resuming, resume_aborted
from roll_core.pipelines.metrics import StepLog, domain_metrics, reward_metrics, trained_domain_shares
from roll_core.pipelines.rollout import (
    PromptsTooLong,
    assemble,
    check_context,
    check_pictures,
    eval_log,
    evaluate,
    picture_token_ids,
    prompt_batch,
    vision_processor,
)
from roll_core.pipelines.sampling import RM_ROW_TENSORS, group_rows, informative_groups, merge_scored
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)


def env_label(cfg: Any) -> str | None:
    """The run's env as a user names it: `env.name`, else (an agentic env's name is null: its display name)
    `env.env`, the environment it plays."""
    env = cfg.env
    return getattr(env, "name", None) or getattr(env, "env", None)


def check_task(cfg: Any, task: Any) -> None:
    """A single-turn task with training problems, a multi-domain task's env.counts summing to the batch size, and
    held-out problems when the run evaluates."""
    from roll_core.interfaces.tasks import AgenticTask

    if isinstance(task, AgenticTask):
        raise ConfigError(
            f"env={env_label(cfg)} is a multi-turn environment, which pipeline={cfg.pipeline.name} cannot run "
            "(it samples single-turn prompts): use pipeline=agentic"
        )
    if not task.train_set():
        raise ConfigError(f"env={env_label(cfg)}: the training set is empty: check the data (env.path)")
    if hasattr(task, "domain_slices") and hasattr(task, "mixture"):  # env.counts against the batch size, now
        check_counts(task.mixture()[1], cfg.pipeline.rollout_batch_size)
    if cfg.pipeline.eval_every > 0 and not task.eval_set()[: cfg.pipeline.eval_size]:
        raise ConfigError(
            f"pipeline.eval_every={cfg.pipeline.eval_every} but the held-out set of env={env_label(cfg)} is empty "
            f"(pipeline.eval_size={cfg.pipeline.eval_size}): give it held-out problems (env.eval_size, "
            "env.eval_path) or set pipeline.eval_every=0"
        )


class PromptCollector:
    """Scored batches of prompts x responses, generated under the current weights (see the module docstring)."""

    plot_keys: tuple[str, ...] = ("reward/mean", "reward/accuracy", "eval/accuracy")
    trajectories = False

    def __init__(self, ctx: CollectorContext) -> None:
        cfg = ctx.cfg
        self.cfg, self.ctx = cfg, ctx
        self.tokenizer, self.task, self.infer = ctx.tokenizer, ctx.task, ctx.infer
        self.sampling = ctx.sampling
        check_task(cfg, self.task)
        check_context(cfg.infer_engine.max_model_len, self.tokenizer, cfg.model.chat_template_kwargs)
        self.train_set = self.task.train_set()
        # Held-out problems beyond pipeline.eval_size: neither trained nor evaluated (`_data_counts`); a cut leaving
        # a domain out is a warning when the run evaluates.
        self.eval_set, self.eval_cut = first_eval_size(
            self.task.eval_set(), cfg.pipeline.eval_size, evaluates=cfg.pipeline.eval_every > 0
        )
        # A vision-language model's prompt processor (None for text); pictures for a text model end the run here.
        self.processor = vision_processor(ctx.model_path, self.tokenizer, cfg.model)
        check_pictures(self.processor, [*self.train_set, *self.eval_set], cfg.model.path)
        self.sampler = make_sampler(self.task, batch_size=cfg.pipeline.rollout_batch_size, seed=cfg.pipeline.seed)
        # Training-set indices drawn before a checkpoint but not yet trained (the asynchronous collector's groups
        # in flight), restored from it: drawn again first, before the sampler's next ones.
        self._replay: list[int] = []
        # A multi-domain task: metrics, curves and evaluation per domain too.
        self.domains: list[str] = list(getattr(self.task, "domains", ()) or ())
        if len(self.domains) > 1:
            self.plot_keys = (
                *type(self).plot_keys,
                *(f"domain/{d}/accuracy" for d in self.domains),
                *(f"eval/{d}/accuracy" for d in self.domains),
            )
        scale = getattr(self.task, "advantage_scale", None) or {}
        self.advantage_scale = scale if any(v != 1.0 for v in scale.values()) else None
        # A reward failing on every row for pipeline.max_reward_failure_steps steps stops the run; totals go to
        # the summary.
        self.reward_budget = RewardFailureBudget(cfg.pipeline.max_reward_failure_steps)
        self._step_counters: dict[str, float] = {}
        self._step_failure: str | None = None
        # The reward role: workers that decode and score responses with the task's reward.
        self.reward = ctx.cluster.group(
            RewardGroup,
            "reward",
            cfg.pipeline.reward_workers,
            env=as_dict(cfg.env),
            tokenizer_path=cfg.model.tokenizer or ctx.model_path,
            guard=cfg.pipeline.reward_guard(),  # errors, NaN and hangs become counted rows
            chat_template_kwargs=cfg.model.chat_template_kwargs,  # as the prompts were rendered
        )
        # The reward model role (reward_model=hf): scores after the task's reward, adds to or replaces its scores.
        self.reward_model = None
        if getattr(cfg, "reward_model", None) is not None:
            from roll_core.pipelines.reward_model import build_reward_model

            self.reward_model = build_reward_model(ctx)
        self.scoring = _Scoring(self.reward, self.reward_model)

    # ---- the collector contract ---------------------------------------------------------------------------
    def next(self, step: int, out: StepLog) -> Collected | None:
        """rollout_batch_size prompts x group_size responses, scored (refilled with dynamic sampling)."""
        batch = self._generate_scored(step, self.cfg.pipeline.rollout_batch_size, 0, out)
        if self.cfg.algo.drop_uniform_groups:
            batch = self._keep_informative(step, batch, out)
        if self.reward_model is not None and batch is not None:  # normalize=batch: over the whole batch's rows
            batch = self.reward_model.renormalise(batch)
        out.update(reward_counts(self.end_reward_step(step)))  # every round's rows, not the first round's only
        return self._collected(batch, out)

    def begin_sync(self) -> None:
        return None  # nothing runs between two steps

    def finish_sync(self, version: int) -> None:
        return None

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy: one sample per held-out problem at the eval temperature, a failed one (refused by the
        engine, or the reward failed on it) counted wrong as roll-eval counts it, with `eval/accuracy_stderr` (its
        standard error over the problems, None for fewer than two); `eval/n`: the problems scored, not those skipped
        for a prompt over model.max_prompt_length or one filling the engine's context, which count in
        `eval/skipped_long_prompts` and `eval/skipped_context_prompts` (rollout.eval_log)."""
        t0 = time.perf_counter()
        if self.reward_model is not None:  # an earlier evaluation's (the distill teacher's) are not this one's
            self.reward_model.take_eval_metrics()
        res = evaluate(
            # an engine's own abort is resumed, not scored 0; refused after pipeline.max_idle_aborts idle ones
            _Resuming(self.infer, self._pad_id, self._cut_ids, self.cfg.pipeline.max_idle_aborts, self.tokenizer),
            self.scoring,
            self.tokenizer,
            self.task,
            self.eval_set,
            max_prompt_length=self.cfg.model.max_prompt_length,
            template_kwargs=self.cfg.model.chat_template_kwargs,
            processor=self.processor,
            params=self.sampling.replace(
                temperature=self.eval_temperature, seed=derive_seed(self.cfg.pipeline.seed, Purpose.EVAL)
            ),
        )
        out = {**eval_log(res), "eval/seconds": time.perf_counter() - t0}
        if self.reward_model is not None:  # eval/reward_model/raw_mean...: the model's scores on its own scale
            out.update(self.reward_model.take_eval_metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        state = {
            "sampler": self.sampler.state_dict(),
            "reward_budget": self.reward_budget.state_dict(),
            "data": self._fingerprint(),
        }
        if self._replay:  # drawn again first by the resumed run
            state["pending"] = list(self._replay)
        if self.reward_model is not None:  # its running statistics (normalize=running) resume too
            state["reward_model"] = self.reward_model.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])  # (refuses a training set of another size)
        if state.get("data", self._fingerprint()) != self._fingerprint():
            # Same size, other problems (a data file edited in place): the saved position now points elsewhere.
            log.warning(
                "the training set differs from the one the checkpoint was saved with (same %d prompts in number, "
                "not the same prompts or order): the saved data position applies to the new list, so some "
                "prompts of this epoch may be repeated or skipped",
                len(self.train_set),
            )
        self._replay = [int(i) for i in state.get("pending", ())]
        if "reward_budget" in state:
            self.reward_budget.load_state_dict(state["reward_budget"])
        if self.reward_model is not None and "reward_model" in state:
            self.reward_model.load_state_dict(state["reward_model"])

    def summary(self) -> dict[str, Any]:
        """Reward failures of the run (rows, failed rows by cause, steps whose rows all failed), the data rows
        skipped when the task loaded its files and the training rows it left out as held out (`data_counts`)."""
        out = {**self.reward_budget.summary(), **self._data_counts()}
        if self.reward_model is not None:
            out["reward_model"] = self.reward_model.summary()
        return out

    def close(self) -> None:
        if self.reward_model is not None:
            self.reward_model.close()

    # ---- pieces -------------------------------------------------------------------------------------------
    def _data_counts(self) -> dict[str, Any]:
        """The task's `data_counts`, its `unused_held_out` plus the held-out problems beyond pipeline.eval_size
        (`eval_cut`), which the run neither trains on nor evaluates (the cut was not counted anywhere)."""
        return with_eval_cut(self.task, getattr(self, "eval_cut", 0))

    @property
    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None else int(pad)

    @property
    def _cut_ids(self) -> frozenset[int]:
        """Picture placeholder ids a response is cut before (a vision-language model's; none for text)."""
        if getattr(self, "processor", None) is None:
            return frozenset()
        return frozenset(picture_token_ids(self.tokenizer))

    @property
    def eval_temperature(self) -> float:
        t = self.cfg.pipeline.eval_temperature
        return self.sampling.temperature if t is None else float(t)

    def _collected(self, batch: Batch | None, out: StepLog) -> Collected | None:
        if batch is None or len(batch) == 0:
            return None
        out["data/trained_groups"] = len(batch) // self.cfg.algo.group_size
        out.update(data_metrics(self._data_counts()))  # data/skipped_rows, data/also_held_out, ...
        # Epochs of the training set drawn (the least drawn domain's with several; the asynchronous collector's
        # includes the groups it started ahead).
        out["data/epoch"] = self.sampler.progress()
        if len(self.domains) > 1:  # the trained mix, after dynamic sampling's filter (the sampled one: `share`)
            out.update(trained_domain_shares(batch, self.domains))
        if "mm_inputs" in batch:  # the trainer takes the tensors; the PIL pictures were for the engines
            batch["mm_inputs"] = without_images(batch["mm_inputs"])
        if self.sampling.structured is not None:  # the trainer replays the constraint over each response
            from roll_core.interfaces.inference import STRUCTURED_KEY, structured_rows

            batch[STRUCTURED_KEY] = structured_rows([self.sampling.structured] * len(batch))
        if self.advantage_scale is not None:  # per-domain advantage scale: (B,), the trainer multiplies
            batch["advantage_scale"] = torch.tensor(
                [self.advantage_scale[m["domain"]] for m in batch["metadata"]], dtype=torch.float32
            )
        return Collected(batch, self.shaped_scores(batch))

    def shaped_scores(self, batch: Batch) -> torch.Tensor:
        """(B,) scores with the overlong penalty and reward clipping applied."""
        algo, model = self.cfg.algo, self.cfg.model
        scores = batch["scores"].clone()
        if algo.overlong_buffer > 0:
            scores = scores + overlong_penalty(
                batch["response_mask"].sum(-1), max_length=model.max_response_length, buffer=algo.overlong_buffer
            )
        if algo.reward_clip is not None:
            scores = scores.clamp(-algo.reward_clip, algo.reward_clip)
        return scores

    def _generate_scored(self, step: int, n_prompts: int, round_: int, out: StepLog) -> Batch:
        """Sample `n_prompts` prompts x group_size responses, assemble and score them; the reward metrics of the
        first round go to `out` (the unfiltered sample's), while the counts of every round (skips, resumed rows,
        `perf/rollout_tokens`: the responses' tokens generated) add up, and `perf/rollout_tokens_per_s` is over
        every round's tokens and generation time: a dynamic-sampling refill costs what it generates."""
        algo, model = self.cfg.algo, self.cfg.model
        first = round_ == 0
        g = algo.group_size
        problems = [self.train_set[i] for i in self._draw(n_prompts)]
        counts: dict[str, Any] = {"data/skipped_long_prompts": 0, "data/resumed_rows": 0, "data/refused_prompts": 0}
        prompts = self._prompt_batch(problems, counts)
        with out.timer("generate"):
            seed = derive_seed(self.cfg.pipeline.seed, Purpose.ROLLOUT, step, round_)  # refills draw fresh streams
            params = self.sampling.replace(seed=seed)
            gen = self.infer.generate(prompts, params, n=g)
            gen, refused, counts["data/resumed_rows"] = resume_aborted(
                self.infer,
                prompts,
                gen,
                params,
                g,
                self._pad_id,
                self._cut_ids,
                max_idle_aborts=self.cfg.pipeline.max_idle_aborts,  # the engine's idle aborts in a row: a refusal
                tokenizer=self.tokenizer,  # a stop string split across a resume point
            )
        if first:
            self._generated = [0, 0.0]  # the step's response tokens and the engine's seconds, every round
        self._generated[0] += int(gen["response_mask"].sum())  # refused rows' included: the engine generated them
        self._generated[1] += float(gen.meta["generate_seconds"])
        out["perf/rollout_tokens"] = float(self._generated[0])
        out["perf/rollout_tokens_per_s"] = self._generated[0] / max(self._generated[1], 1e-9)
        rows = prompts.repeat_interleave(g)
        if refused:  # the whole group goes: a group missing a row would shift its baseline (GRPO's mean and std)
            dropped = sorted({i // g for i in refused})
            keep = [i for i in range(len(rows)) if i // g not in dropped]
            counts["data/refused_prompts"] = len(dropped)
            if not keep:
                n = self.cfg.pipeline.max_idle_aborts
                raise RuntimeError(
                    f"the inference engine refused every prompt of the step ({n} aborts in a row without a token "
                    "each; SGLang aborts a prompt longer than its KV cache holds): lower model.max_prompt_length or "
                    f"give the engine more memory; an engine that only pauses that often: raise {IDLE_ABORTS_KEY}, "
                    f"now {n}"
                )
            rows, gen = rows.index(keep), gen.index(keep)
        batch = assemble(self.tokenizer, rows, gen, counts)
        scored = self.score(batch, out)
        extra = [k for k in RM_ROW_TENSORS if k in scored]  # a reward model's normalize=batch: see renormalise
        batch = batch.union(scored.select("scores", "correct", "formatted", *extra))
        for k, v in counts.items():  # skips of every round count
            out[k] = out.get(k, 0) + v
        if first:
            lengths = batch["response_mask"].sum(-1)
            out.update(reward_metrics(batch, scored, lengths, model.max_response_length))
            if len(self.domains) > 1:
                out.update(domain_metrics(batch, lengths, model.max_response_length, self.domains))
            self.log_samples(step, batch, scored)
        return batch

    def score(self, batch: Batch, out: StepLog) -> Batch:
        """The reward role's scores of `batch`; its failure counters add up for the step's failure budget."""
        with out.timer("reward"):
            scored = self.reward.score(batch)
        if self.reward_model is not None:
            with out.timer("reward_model"):
                self.reward_model.apply(batch, scored, out)
        for k, v in scored.meta.get("reward_counters", {}).items():
            self._step_counters[k] = self._step_counters.get(k, 0) + v
        self._step_failure = self._step_failure or scored.meta.get("reward_failure")
        return scored

    def end_reward_step(self, step: int) -> dict[str, float]:
        """Charge the step's reward failures to the budget (raises RewardFailureError when it is spent); returns
        the step's reward counters, summed over every batch scored (dynamic sampling's refills included)."""
        counters, failure = self._step_counters, self._step_failure
        self._step_counters, self._step_failure = {}, None
        self.reward_budget.update(step, counters, failure)
        return counters

    def _keep_informative(self, step: int, batch: Batch, out: StepLog) -> Batch:
        """DAPO dynamic sampling, a filter on the drawn groups: keep the groups whose rewards differ and draw more
        prompts until the batch holds rollout_batch_size of them, or algo.refill_max_batches batches' worth of
        groups were sampled."""
        algo, pipe = self.cfg.algo, self.cfg.pipeline
        g, want = algo.group_size, pipe.rollout_batch_size
        cap = math.ceil(algo.refill_max_batches * want)
        parts: list[Batch] = []
        kept = sampled = dropped = round_ = 0
        while True:
            informative = informative_groups(batch["scores"], g)
            sampled += len(informative)
            dropped += int((~informative).sum())
            take = informative & (informative.cumsum(0) <= want - kept)  # never more than the batch needs
            kept += int(take.sum())
            parts.append(batch.index(group_rows(take, g)))
            missing = want - kept
            if missing <= 0 or sampled >= cap:
                break
            round_ += 1
            more = min(math.ceil(missing * algo.refill_oversample), cap - sampled)
            batch = self._generate_scored(step, more, round_, out)
        out["data/dropped_groups"] = dropped
        out["data/refill_rounds"] = round_
        out["data/sampled_groups"] = sampled
        out["data/refill_short_groups"] = max(0, want - kept)
        if kept < want:
            log.warning(
                "dynamic sampling: %d of %d groups have reward variance after sampling %d groups "
                "(algo.refill_max_batches=%s); training on %d",
                kept,
                want,
                sampled,
                algo.refill_max_batches,
                kept,
            )
        parts = [p for p in parts if len(p)]
        if len(parts) <= 1:
            return parts[0] if parts else batch.index([])
        return merge_scored(self.tokenizer, parts)

    def _prompt_batch(self, problems: list[Any], counts: dict[str, Any]) -> Batch:
        """Prompts of `problems`. A draw whose every prompt is too long (a few huge data rows met by a small batch)
        draws again, as the asynchronous collector does, up to one pass over the training set: a handful of bad
        rows never ends a run; each skip counts in data/skipped_long_prompts."""
        limit, skipped, kwargs = self.cfg.model.max_prompt_length, 0, self.cfg.model.chat_template_kwargs
        for _ in range(math.ceil(len(self.train_set) / max(1, len(problems))) - 1):
            try:
                batch = prompt_batch(self.tokenizer, self.task, problems, limit, counts, kwargs, self.processor)
            except PromptsTooLong:
                skipped += len(problems)
                problems = [self.train_set[i] for i in self._draw(len(problems))]
                continue
            break
        else:  # the last draw raises when it fits no better, naming the limit
            batch = prompt_batch(self.tokenizer, self.task, problems, limit, counts, kwargs, self.processor)
        counts["data/skipped_long_prompts"] += skipped
        return batch

    def _fingerprint(self) -> str:
        if not hasattr(self, "_data_fingerprint"):  # the training list never changes within a run
            self._data_fingerprint = data_fingerprint(self.train_set)
        return self._data_fingerprint

    def _draw(self, k: int) -> list[int]:
        """The next `k` training-set indices: the checkpoint's pending ones first, then the sampler's."""
        head, self._replay = self._replay[:k], self._replay[k:]
        return head + (self.sampler.next(k - len(head)) if k > len(head) else [])

    def log_samples(self, step: int, batch: Batch, scored: Batch, k: int = 2) -> None:
        """A few responses of the step, with their problem, answer and score, to the tracker's samples file."""
        texts = scored["response_text"]
        self.ctx.samples(
            step,
            [
                {
                    "problem": batch["problem_id"][i],
                    **({"domain": batch["metadata"][i].get("domain")} if len(self.domains) > 1 else {}),
                    "answer": batch["answer"][i],
                    "response": texts[i],
                    "score": float(batch["scores"][i]),
                }
                for i in range(min(k, len(texts)))
            ],
        )


def reward_counts(counters: dict[str, float]) -> dict[str, float]:
    """The step metrics `reward/<counter>` (rows scored, failed rows by cause) of the step's summed reward counters.

    `reward_metrics` names them alike from the first batch scored; these replace them with every batch's (dynamic
    sampling's refill rounds, the asynchronous collector's later takes), as the failure budget counts them."""
    return {f"reward/{k}": float(v) for k, v in counters.items()}


def without_images(rows: list[Any]) -> list[Any]:
    """Each row's MMInputs without its PIL pictures; rows that shared one object (a group) still share one."""
    done: dict[int, Any] = {}
    return [None if m is None else done.setdefault(id(m), m.without_images()) for m in rows]


class _Scoring:
    """What evaluation scores with: the reward role, then the reward model when there is one (no step metrics, no
    running-statistics update: `apply(..., out=None)`; its `eval/reward_model/` metrics are the collector's to take:
    RewardModelScoring.take_eval_metrics)."""

    def __init__(self, reward: RewardGroup, reward_model: Any) -> None:
        self.reward, self.reward_model = reward, reward_model

    def score(self, batch: Batch) -> Batch:
        scored = self.reward.score(batch)
        if self.reward_model is not None:
            self.reward_model.apply(batch, scored, None)
        return scored
