"""The rollout-only collector (`pipeline=rollout`, objective `none`): generate and score a task's prompts with any
inference engine and write the samples as rows; no training model is loaded.

Contract:
- The prompts: the task's training set in its order, the first `rollout.max_prompts` of them (all when null),
  of which shard `rollout.shard` of `rollout.num_shards` takes every num_shards-th from its index (shards
  partition the prompts exactly). Each step takes the next `pipeline.rollout_batch_size` of them and samples
  `rollout.samples_per_prompt` responses each (seed: pipeline.seed, step and shard), scores them with the task's
  reward (the reward workers, guard, failure budget and optional reward model of the RLVR prompts collector,
  which this one composes) and appends one row per sample to `rollout.output` (roll_core.posttrain.writer: the
  layouts and row fields). `next` returns None: nothing trains.
- `exhausted` turns True in the step that takes the shard's last prompts: the loop checkpoints and ends the run
  (pipeline=rollout sets pipeline.max_steps high: the data decides). `total_steps` is how many steps that takes.
- Text prompts only: a task with pictures is a ConfigError (the rows cannot carry them yet).
- A prompt longer than model.max_prompt_length, or filling the engine's context, is skipped and counted
  (data/skipped_long_prompts, data/skipped_context_prompts, the summary's `rollout.skipped_prompts`): never cut.
- Resume: the state holds the prompts done, the output's extent and a fingerprint of the shard's prompt ids;
  rows written after the checkpoint are dropped, so a stopped and resumed run writes exactly the rows of an
  uninterrupted one (same seed, synchronous engines on CPU). A changed shard, cap, samples per prompt, output
  or task is refused on resume.
- Metrics per step: reward/* and response/* as RL reports them, rollout/rows (written so far), rollout/step_rows,
  rollout/prompts_done, rollout/prompts_total. `evaluate` is the RLVR collector's held-out accuracy (only when
  pipeline.eval_every > 0; pipeline=rollout sets 0).
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import CollectorContext
from roll_core.pipelines.collectors.prompts import PromptCollector, check_task, resume_aborted
from roll_core.pipelines.metrics import StepLog, domain_metrics, reward_metrics
from roll_core.pipelines.rollout import PromptsTooLong, assemble, picture_token_ids, prompt_batch
from roll_core.posttrain.writer import ROW_FIELDS, RolloutWriter, holds_rows, output_kind
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)


def shard_indices(n: int, max_prompts: int | None, shard: int, num_shards: int) -> list[int]:
    """Indices into a training set of `n` prompts that shard `shard` of `num_shards` generates for: of the first
    `max_prompts` (all when None), every num_shards-th from `shard`."""
    return list(range(min(n, max_prompts) if max_prompts is not None else n))[shard::num_shards]


def _fingerprint(ids: list[str]) -> str:
    """A short hash of the shard's prompt ids, in order (a resumed run must see the same prompts)."""
    h = hashlib.blake2b(digest_size=8)
    for i in ids:
        h.update(str(i).encode() + b"\0")
    return h.hexdigest()


class RolloutCollector:
    """Generates, scores and writes a shard of a task's prompts (see the module docstring)."""

    #: No curves.png: nothing learns, and a long generation job would redraw it at every step.
    plot_keys: tuple[str, ...] = ()
    trajectories = False
    #: No policy trains: the engines' weights never change.
    on_policy = False
    #: `next` returns None every step by design (nothing trains): no step counts as one that trained nothing
    #: (pipeline.max_empty_steps, roll_core.pipelines.empty_steps).
    empty_by_design = True

    def __init__(self, ctx: CollectorContext) -> None:
        cfg = ctx.cfg
        self.cfg, self.ctx, self.ro = cfg, ctx, cfg.rollout
        # The RLVR prompts collector's scoring side: reward workers (guarded), reward model, failure budget,
        # samples log and held-out evaluation. Its own prompt sampler stays unused.
        self.scoring = PromptCollector(ctx)
        self.task, self.tokenizer, self.infer = ctx.task, ctx.tokenizer, ctx.infer
        train_set = self.task.train_set()
        self.indices = shard_indices(len(train_set), self.ro.max_prompts, self.ro.shard, self.ro.num_shards)
        if not self.indices:
            raise ConfigError(
                f"rollout.shard={self.ro.shard} of rollout.num_shards={self.ro.num_shards} holds no prompt (the task "
                f"has {len(train_set)} training prompts, rollout.max_prompts={self.ro.max_prompts}): use fewer shards"
            )
        self.problems = [train_set[i] for i in self.indices]
        pictured = next((p for p in self.problems if getattr(p, "images", None)), None)
        if pictured is not None:  # (a text model was refused above, by the scoring side's picture check)
            raise ConfigError(
                f"pipeline=rollout does not take pictures yet (problem {pictured.id} of env={cfg.env.name} has some): "
                "its rows hold token ids and text only, and a later SFT or DPO run on them would train without "
                "the pictures. Use a text task"
            )
        self.fingerprint = _fingerprint([p.id for p in self.problems])
        self.output = resolve_output(cfg, ctx)
        self.writer = RolloutWriter(self.output)
        if not (cfg.pipeline.resume or cfg.pipeline.resume_from) and holds_rows(self.output):
            self.writer.start(resume=False)  # raises, naming the output: said before any generation
        self.done = 0  # prompts of the shard taken (generated or skipped)
        self.steps = 0  # steps that took prompts
        self.skipped = 0  # prompts skipped (too long for the limit or the engine's context)
        self.reward_failed_rows = 0  # samples the reward could not score (not written)

    # ---- progress -------------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Prompts in this shard."""
        return len(self.problems)

    @property
    def exhausted(self) -> bool:
        """True once every prompt of the shard was taken: the run ends."""
        return self.done >= self.total

    @property
    def total_steps(self) -> int:
        """Steps the whole shard takes (the progress bar's length): those taken and those the rest needs (a
        resumed run may change pipeline.rollout_batch_size)."""
        return self.steps + math.ceil((self.total - self.done) / self.cfg.pipeline.rollout_batch_size)

    # ---- the collector contract -----------------------------------------------------------------------------
    def next(self, step: int, out: StepLog) -> None:
        """Generate, score and write the next rollout_batch_size prompts x samples_per_prompt; returns None."""
        if not self.writer.ready:  # no checkpoint was loaded: a fresh run, or a resumed one before its first
            # A resumed run that never checkpointed drops the rows it wrote, but only from an output in its own
            # run folder: an output elsewhere (shared by job scripts) may hold another run's rows (it was emptied).
            run_dir = Path(self.ctx.tracker.dir).resolve() if self.ctx.tracker is not None else None
            own = run_dir is not None and self.output.resolve().is_relative_to(run_dir)
            self.writer.start(resume=bool(self.cfg.pipeline.resume or self.cfg.pipeline.resume_from) and own)
        problems = self.problems[self.done : self.done + self.cfg.pipeline.rollout_batch_size]
        rows: list[dict[str, Any]] = []
        if problems:
            rows = self._rows(step, problems, out)
            self.writer.write(step, rows)
            self.done += len(problems)
            self.steps += 1
        out["rollout/step_rows"] = float(len(rows))
        out["rollout/rows"] = float(self.writer.rows)
        out["rollout/prompts_done"] = float(self.done)
        out["rollout/prompts_total"] = float(self.total)
        return None

    def begin_sync(self) -> None:
        return None

    def finish_sync(self, version: int) -> None:
        return None

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy of the engines' model (the RLVR collector's evaluation)."""
        return self.scoring.evaluate(step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "prompts_done": self.done,
            "steps": self.steps,
            "skipped_prompts": self.skipped,
            "reward_failed_rows": self.reward_failed_rows,
            "prompts_total": self.total,
            "fingerprint": self.fingerprint,
            "settings": self._settings(),
            "writer": self.writer.state_dict(),
            "scoring": self.scoring.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the checkpoint left off; rows written after it are dropped from the output."""
        saved, now = state["settings"], self._settings()
        changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in now.items() if saved.get(k) != v]
        if changed:
            raise ConfigError(
                "a rollout run cannot change what it generates on resume (" + "; ".join(changed) + "): set them back "
                "or start a new run"
            )
        if state["fingerprint"] != self.fingerprint:
            raise ConfigError(
                "the task's training prompts differ from the checkpoint's (env settings or data changed): resume "
                "with the same task or start a new run"
            )
        self.writer.restore(state["writer"])
        self.done, self.steps, self.skipped = (int(state[k]) for k in ("prompts_done", "steps", "skipped_prompts"))
        self.reward_failed_rows = int(state.get("reward_failed_rows", 0))
        self.scoring.load_state_dict(state["scoring"])

    def summary(self) -> dict[str, Any]:
        """The scoring side's totals (reward failures, skipped data rows) and the output's."""
        return {
            **self.scoring.summary(),
            "rollout": {
                "output": str(self.output),
                "rows": self.writer.rows,
                "prompts_done": self.done,
                "prompts_total": self.total,
                "skipped_prompts": self.skipped,
                "reward_failed_rows": self.reward_failed_rows,
            },
        }

    def close(self) -> None:
        self.scoring.close()

    # ---- pieces ---------------------------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        ro = self.ro
        return {
            "shard": ro.shard,
            "num_shards": ro.num_shards,
            "max_prompts": ro.max_prompts,
            "samples_per_prompt": ro.samples_per_prompt,
            "output": str(self.output),
        }

    def _rows(self, step: int, problems: list[Any], out: StepLog) -> list[dict[str, Any]]:
        """The step's rows: prompts (too long ones skipped and counted), samples, scores."""
        n = self.ro.samples_per_prompt
        counts: dict[str, Any] = {"data/skipped_long_prompts": 0}
        batch: Batch | None = None
        try:
            prompts = prompt_batch(
                self.tokenizer,
                self.task,
                problems,
                self.cfg.model.max_prompt_length,
                counts,
                self.cfg.model.chat_template_kwargs,
            )
        except PromptsTooLong:  # every prompt of the step: skipped and counted, the shard goes on
            counts["data/skipped_long_prompts"] = len(problems)
            prompts = None
        if prompts is not None:
            with out.timer("generate"):
                # ids: step, refill round 0, shard (shards draw different streams at the same step)
                seed = derive_seed(self.cfg.pipeline.seed, Purpose.ROLLOUT, step, 0, self.ro.shard)
                params = self.ctx.sampling.replace(seed=seed)
                gen = self.infer.generate(prompts, params, n=n)
                # A row the engine aborted on its own is resumed, never written as an answer (prompts.resume_aborted).
                pad = self.tokenizer.pad_token_id
                cut = frozenset(picture_token_ids(self.tokenizer)) if "mm_inputs" in prompts else frozenset()
                gen, refused, counts["data/resumed_rows"] = resume_aborted(
                    self.infer,
                    prompts,
                    gen,
                    params,
                    n,
                    0 if pad is None else int(pad),
                    cut,
                    max_idle_aborts=self.cfg.pipeline.max_idle_aborts,
                    tokenizer=self.tokenizer,
                )
            repeated = prompts.repeat_interleave(n)
            repeated["sample"] = [i % n for i in range(len(repeated))]
            if refused:  # rows the engine kept refusing: no sample of the policy to write
                counts["data/refused_rows"] = len(refused)
                keep = [i for i in range(len(repeated)) if i not in set(refused)]
                repeated, gen = (repeated.index(keep), gen.index(keep)) if keep else (None, None)
            try:
                batch = assemble(self.tokenizer, repeated, gen, counts) if gen is not None else None
            except ValueError:  # every prompt fills the engine's context (assemble logged it)
                counts["data/skipped_context_prompts"] = len(prompts)
                batch = None
        skipped = counts["data/skipped_long_prompts"] + counts.get("data/skipped_context_prompts", 0)
        self.skipped += skipped
        out.update({k: float(v) for k, v in counts.items()})
        out["rollout/skipped_prompts"] = float(self.skipped)
        if batch is None:
            self.scoring.end_reward_step(step)
            return []
        scored = self.scoring.score(batch, out)
        self.scoring.end_reward_step(step)  # raises once every row failed for max_reward_failure_steps steps
        batch = batch.union(scored.select("scores", "correct", "formatted"))
        lengths = batch["response_mask"].sum(-1)
        out.update(reward_metrics(batch, scored, lengths, self.cfg.model.max_response_length))
        if len(self.scoring.domains) > 1:
            out.update(domain_metrics(batch, lengths, self.cfg.model.max_response_length, self.scoring.domains))
        out["perf/rollout_tokens_per_s"] = float(gen["response_mask"].sum()) / max(gen.meta["generate_seconds"], 1e-9)
        self.scoring.log_samples(step, batch, scored)
        rows = rows_of(batch, scored["response_text"], self.ro.shard)
        if "reward_failed" in scored:
            # A row the reward could not score carries a fallback score: written, it would read as a wrong answer
            # (DPO's rejected side, dropped by data.min_score). Left out, counted and logged.
            bad = scored["reward_failed"].tolist()
            if any(bad):
                log.warning(
                    "step %d: the reward could not score %d of %d samples; they are not written (rollout/"
                    "reward_failed_rows)",
                    step,
                    sum(bad),
                    len(bad),
                )
            self.reward_failed_rows += sum(bad)
            rows = [r for r, b in zip(rows, bad, strict=True) if not b]
        out["rollout/reward_failed_rows"] = float(self.reward_failed_rows)
        return rows


def rows_of(batch: Batch, texts: list[str], shard: int) -> list[dict[str, Any]]:
    """One output row per sample of an assembled, scored batch (fields: roll_core.posttrain.writer.ROW_FIELDS)."""
    rows = []
    for i in range(len(batch)):
        mask = batch["response_mask"][i].bool()
        row = {
            "prompt_id": str(batch["problem_id"][i]),
            "prompt": batch["prompt_text"][i],
            "answer": str(batch["answer"][i]),
            "prompt_ids": [int(t) for t in batch["prompt_ids"][i]],
            "response": texts[i],
            "response_ids": batch["responses"][i][mask].tolist(),
            "response_logprobs": batch["behaviour_logprobs"][i][mask].tolist(),
            "reward": float(batch["scores"][i]),
            "correct": bool(batch["correct"][i] > 0.5),
            "formatted": bool(batch["formatted"][i] > 0.5),
            "finish_reason": batch["finish_reason"][i],
            "metadata": dict(batch["metadata"][i]),
            "sample": int(batch["sample"][i]),
            "shard": shard,
        }
        rows.append({k: row[k] for k in ROW_FIELDS})
    return rows


def resolve_output(cfg: Any, ctx: CollectorContext | None) -> Path:
    """rollout.output as this shard writes it (roll_core.config.posttrain.RolloutConfig.output_path), or
    <run folder>/rollout.jsonl."""
    path = cfg.rollout.output_path()
    if path is None:
        if ctx is None or ctx.tracker is None:
            raise ConfigError("rollout.output is not set and this run has no run folder: set rollout.output")
        return Path(ctx.tracker.dir) / "rollout.jsonl"
    return Path(path).expanduser().resolve()


class _RolloutOnly:
    """`pipeline=rollout`: generate, score and write a task's prompts; the `none` objective (nothing trains)."""

    trajectories = False
    objective = "none"

    def check(self, cfg: Any, task: Any) -> None:
        """A single-turn task with training prompts; an output that names a layout and holds no other run's rows."""
        from roll_core.pipelines.collectors import refuse_async

        refuse_async(cfg, "rollout", "trains nothing, so there is no trainer to run ahead of")
        check_task(cfg, task)
        path = cfg.rollout.output_path()
        if path is not None:
            output_kind(path)
            if not (cfg.pipeline.resume or cfg.pipeline.resume_from) and holds_rows(Path(path).expanduser()):
                raise ConfigError(
                    f"rollout.output={path} already holds rows: delete it, choose another rollout.output, or resume "
                    "the run that wrote it (pipeline.resume=true)"
                )

    def __call__(self, ctx: CollectorContext) -> RolloutCollector:
        return RolloutCollector(ctx)


rollout_collectors = _RolloutOnly()
