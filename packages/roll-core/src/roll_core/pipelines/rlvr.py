"""The RLVR pipeline, top to bottom: generate -> reward -> reference -> old log-probs -> values -> advantages ->
train critic -> train actor -> sync weights -> log -> checkpoint.

The controller is this one process. Roles are worker groups (roll_core.cluster.roles) on the `local` backend
(all in this process, debuggable) or on Ray; the code path is the same. The pipeline takes a typed
`RLVRConfig` (never a DictConfig) and may assume it passed its schema checks.

Determinism: sampling seeds are derived from (seed, step) and the data sampler's position is checkpointed, so a
resumed run on CPU reproduces the uninterrupted run's metrics.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from roll_algos import advantages as A
from roll_algos.kl import AdaptiveKLController, FixedKLController, kl_estimate
from roll_algos.losses import masked_mean, off_policy_weights, overlong_penalty
from roll_core import registry
from roll_core.algorithms import token_rewards_from_scores
from roll_core.checkpoint import CheckpointManager
from roll_core.cluster.launch import Cluster, resolve_python
from roll_core.cluster.mesh import Mesh
from roll_core.cluster.roles import InferGroup, RewardGroup, TrainGroup
from roll_core.cluster.weight_sync import WeightSync
from roll_core.config.build import as_dict, build
from roll_core.config.schema import RLVRConfig
from roll_core.data import PromptSampler
from roll_core.errors import ConfigError
from roll_core.interfaces import SamplingParams, UnsupportedSamplingError
from roll_core.models import resolve_model_path
from roll_core.pipelines.metrics import reward_metrics, timer
from roll_core.pipelines.objectives import PolicyObjective, ValueObjective
from roll_core.pipelines.rollout import PromptsTooLong, assemble, evaluate, prompt_batch
from roll_core.pipelines.run_control import GracefulStop, resolve_run_folder
from roll_core.pipelines.sampling import group_rows, informative_groups, merge_scored
from roll_core.protocol import Batch
from roll_core.tracking import Tracker

log = logging.getLogger(__name__)


class RLVRPipeline:
    """Builds the roles from a config and runs `pipeline.max_steps` RL steps."""

    #: Metrics drawn in curves.png (one panel each, when present).
    PLOT_KEYS: tuple[str, ...] = ("reward/mean", "reward/accuracy", "eval/accuracy")
    #: Run restarts since the last logged step (set by run_control.run_with_restarts), logged once.
    pending_run_restarts: int = 0

    def __init__(self, cfg: RLVRConfig, output_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        algo, model, pipe = cfg.algo, cfg.model, cfg.pipeline
        self.cluster = Cluster(cfg.cluster, cfg.hw)
        self.cluster.platform.seed_everything(pipe.seed)
        out = Path(output_dir or pipe.output_dir or Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S"))
        self.out = resolve_run_folder(out, pipe.resume, pipe.resume_from, cfg.experiment)
        self.model_path = resolve_model_path(model.path)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            model.tokenizer or self.model_path, trust_remote_code=model.trust_remote_code
        )
        self.task = build(cfg.env)
        self._setup_data()
        self.estimator = self._setup_estimator()
        self.kl_ctl = (
            AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
            if algo.kl_target
            else FixedKLController(algo.kl_coef)
        )

        rows = pipe.rollout_batch_size * algo.group_size
        if algo.num_mini_batches:
            self.mini_batches = algo.num_mini_batches
        else:
            self.mini_batches = max(1, rows // algo.mini_batch_size) if algo.mini_batch_size else 1
        total_opt_steps = pipe.max_steps * algo.ppo_epochs * self.mini_batches
        common = {
            "model_path": self.model_path,
            "dtype": model.dtype,
            "attn_implementation": model.attn_implementation,
            "trust_remote_code": model.trust_remote_code,
            "seed": pipe.seed,
            # Each worker resolves its device and `dtype=auto` on its own node (roles.resolve_device).
            "platform": self.cluster.platform.name,
            "device": "auto",
        }
        optim = {
            "weight_decay": algo.weight_decay,
            "warmup_steps": algo.warmup_steps,
            "total_steps": total_opt_steps,
            "lr_schedule": algo.lr_schedule,
            "max_grad_norm": algo.max_grad_norm,
        }
        te, ie = as_dict(cfg.train_engine), as_dict(cfg.infer_engine)
        # Sampling: the trainer's log-probs must use the temperature the rollout was drawn at.
        self.sampling = SamplingParams(
            temperature=float(ie["temperature"]),
            top_p=float(ie["top_p"]),
            top_k=int(ie["top_k"]),
            stop=tuple(ie["stop"]),
            max_new_tokens=model.max_response_length,
        )
        self.temperature = self.sampling.temperature
        # Sharded trainers (Megatron) span TP x CP x PP ranks per replica: data splits by data-parallel rank only.
        self.train_mesh = Mesh.for_world(
            te["world_size"],
            tp=int(te.get("tensor_parallel_size", 1)),
            pp=int(te.get("pipeline_parallel_size", 1)),
            cp=int(te.get("context_parallel_size", 1)),
        )
        self.actor_train = self.cluster.group(
            TrainGroup,
            "actor_train",
            te["world_size"],
            mesh=self.train_mesh,
            engine=te,
            runtime={**common, **optim, "role": "actor", "lr": algo.lr},
        )
        self.actor_infer = self.cluster.group(
            InferGroup,
            "actor_infer",
            ie["world_size"],
            devices_per_worker=int(ie.get("tensor_parallel_size", 1)),
            python=resolve_python(ie["python"], ie["name"]),
            max_concurrency=ie["max_concurrency"] or 64,
            engine=ie,
            runtime={**common, "dtype": ie.get("dtype") or model.dtype, "max_new_tokens": model.max_response_length},
        )
        self._check_infer_engine(ie)
        self.reference = None
        # With LoRA the reference policy is the actor's base with adapters disabled: no second model.
        self.reference_is_base = bool(te.get("lora_rank", 0)) and algo.use_reference
        if algo.use_reference and not self.reference_is_base:
            self.reference = self.cluster.group(
                TrainGroup,
                "reference",
                te["world_size"],
                mesh=self.train_mesh,
                engine=te,
                runtime={**common, "role": "reference", "trainable": False},
            )
        self.critic = None
        if algo.use_critic:
            self.critic = self.cluster.group(
                TrainGroup,
                "critic",
                te["world_size"],
                mesh=self.train_mesh,
                engine=te,
                runtime={**common, **optim, "role": "critic", "lr": algo.critic_lr, "lora_rank": 0},
            )
        self.reward = self._setup_reward()
        self.policy_objective = PolicyObjective(
            variant=algo.policy_loss,
            agg=algo.loss_agg,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip=algo.dual_clip,
            ratio_cap=algo.ratio_cap,
            norm_length=model.max_response_length,
            kl_loss_coef=0.0 if algo.kl_in_reward else algo.kl_coef,
            kl_kind=algo.kl_kind,
            entropy_coef=algo.entropy_coef,
        )
        self.value_objective = ValueObjective(
            clip=algo.value_clip, agg=algo.loss_agg, norm_length=model.max_response_length
        )
        self.weight_sync = WeightSync(
            self.actor_train,
            self.actor_infer,
            transport=ie["sync_transport"],
            bucket_mb=ie["sync_bucket_mb"],
            placement=cfg.cluster.placement,
            platform=self.cluster.platform,
        )
        self.sleep_level = int(ie["sleep_level"])
        self.async_rollout = None
        if pipe.async_ratio > 0:
            from roll_core.pipelines.async_rlvr import AsyncCollector

            self.async_rollout = AsyncCollector(self)
        self.ckpt = CheckpointManager(self.out, keep_last=pipe.keep_last)
        self.cluster.checkpoints = self.ckpt  # a fault roll cannot repair names the checkpoint to resume from
        if cfg.cluster.backend == "ray":  # where every worker landed: nodes, resources, visible devices
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "placement.json").write_text(json.dumps(self.cluster.placement_report(), indent=2))
        self.start_step = 1
        self.bad_steps = 0  # consecutive steps skipped for a non-finite loss or gradient
        latest = self.ckpt.latest() if (pipe.resume or pipe.resume_from) else None
        from omegaconf import OmegaConf

        self.tracker = Tracker(self.out, OmegaConf.to_yaml(OmegaConf.structured(cfg)), resume=latest is not None)
        if latest is not None:
            self._restore(latest)

    # ---- the loop -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train for the remaining steps; returns a summary (final and best held-out accuracy, wall time)."""
        pipe = self.cfg.pipeline
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        if self.start_step == 1 and pipe.eval_every > 0:
            self.tracker.log(0, self.evaluate(0))
        bar = tqdm(
            range(self.start_step, pipe.max_steps + 1),
            desc=self.cfg.experiment,
            unit="step",
            disable=not pipe.progress,
            initial=self.start_step - 1,
            total=pipe.max_steps,
        )
        with GracefulStop() as stop:
            for step in bar:
                metrics = self.step(step)
                if pipe.eval_every > 0 and (step % pipe.eval_every == 0 or step == pipe.max_steps):
                    metrics.update(self.evaluate(step))
                self.tracker.log(step, metrics)
                bar.set_postfix(
                    reward=f"{metrics['reward/mean']:.3f}",
                    acc=f"{metrics['reward/accuracy']:.2f}",
                    sec=f"{metrics['perf/step_seconds']:.1f}",
                )
                saved = (pipe.save_every and step % pipe.save_every == 0) or step == pipe.max_steps
                if saved:
                    self.save(step)
                self.tracker.plot(self.PLOT_KEYS)
                if stop.requested:  # checked last: a signal may arrive anywhere in the step
                    if not saved:
                        self.save(step)
                    log.warning("stopped after step %d: checkpoint %s; pipeline.resume=true continues", step, self.out)
                    break
        self.tracker.close()
        evals = [h["eval/accuracy"] for h in self.tracker.history if h.get("eval/accuracy") is not None]
        summary = {
            "final_eval_accuracy": evals[-1] if evals else None,
            "best_eval_accuracy": max(evals, default=None),
            "first_eval_accuracy": evals[0] if evals else None,
            "final_reward": self.tracker.history[-1].get("reward/mean") if self.tracker.history else None,
            "wall_seconds": time.perf_counter() - t0,
            "output_dir": str(self.out),
            "stopped_by_signal": stop.signum,
        }
        log.info("run finished: %s", summary)
        return summary

    def step(self, step: int) -> dict[str, Any]:
        """One RL step: collect a scored batch, then update the policy (and critic) on it; returns its metrics."""
        timers: dict[str, float] = {}
        t_step = time.perf_counter()
        metrics: dict[str, Any] = {}
        collected = self.collect(step, metrics, timers)
        if collected is not None:
            self.update(step, *collected, metrics, timers)
        metrics.update({f"perf/time_{k}": v for k, v in timers.items()})
        metrics.update(self.cluster.fault_metrics())  # workers restarted, calls timed out (this step)
        metrics["faults/run_restarts"] = float(self.pending_run_restarts)  # this run rebuilt after a fault
        self.pending_run_restarts = 0
        metrics["perf/step_seconds"] = time.perf_counter() - t_step
        if collected is not None:
            metrics["perf/samples_per_s"] = len(collected[0]) / metrics["perf/step_seconds"]
        return metrics

    def collect(
        self, step: int, metrics: dict[str, Any], timers: dict[str, float]
    ) -> tuple[Batch, torch.Tensor] | None:
        """Rollout and rewards: the batch to train on and its per-sample scores (None: nothing to train on)."""
        if self.async_rollout is not None:  # generated ahead, in the background, by the async scheduler
            batch = self.async_rollout.collect(step, metrics, timers)
        else:
            batch = self._generate_scored(step, self.cfg.pipeline.rollout_batch_size, 0, metrics, timers)
            if self.cfg.algo.drop_uniform_groups:
                batch = self._refill(step, batch, metrics, timers)
            self._sleep_engines()
        if batch is None or len(batch) == 0:
            return None
        metrics["data/trained_groups"] = len(batch) // self.cfg.algo.group_size
        return batch, self._shaped_scores(batch)

    def _generate_scored(
        self, step: int, n_prompts: int, round_: int, metrics: dict[str, Any], timers: dict[str, float]
    ) -> Batch:
        """Sample `n_prompts` prompts x group_size responses, assemble and score them; reward metrics of round 0
        go to `metrics`."""
        algo, pipe, model = self.cfg.algo, self.cfg.pipeline, self.cfg.model
        problems = [self.train_set[i] for i in self.sampler.next(n_prompts)]
        m = metrics if round_ == 0 else {}
        prompts = self._prompt_batch(problems, m)
        with timer(timers, "generate"):
            seed = pipe.seed * 100_003 + step + round_ * 10_000_019  # refill rounds draw fresh streams
            gen = self.actor_infer.generate(prompts, self.sampling.replace(seed=seed), n=algo.group_size)
        batch = assemble(self.tokenizer, prompts.repeat_interleave(algo.group_size), gen, m)
        if round_ == 0:
            metrics["perf/rollout_tokens_per_s"] = float(gen["response_mask"].sum()) / max(
                gen.meta["generate_seconds"], 1e-9
            )
        with timer(timers, "reward"):
            scored = self.reward.score(batch)
        batch = batch.union(scored.select("scores", "correct", "formatted"))
        if round_ == 0:
            lengths = batch["response_mask"].sum(-1)
            metrics.update(reward_metrics(batch, scored, lengths, model.max_response_length))
            self._log_samples(step, batch, scored)
        return batch

    def _shaped_scores(self, batch: Batch) -> torch.Tensor:
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

    def _refill(self, step: int, batch: Batch, metrics: dict[str, Any], timers: dict[str, float]) -> Batch:
        """DAPO dynamic sampling: keep the groups whose rewards differ and sample more prompts until the batch holds
        rollout_batch_size of them, or algo.refill_max_batches batches' worth of groups were sampled."""
        algo, pipe = self.cfg.algo, self.cfg.pipeline
        g, want = algo.group_size, pipe.rollout_batch_size
        cap = math.ceil(algo.refill_max_batches * want)
        parts, kept, sampled, dropped, round_ = [], 0, 0, 0, 0
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
            batch = self._generate_scored(step, more, round_, metrics, timers)
        metrics["data/dropped_groups"] = dropped
        metrics["data/refill_rounds"] = round_
        metrics["data/sampled_groups"] = sampled
        metrics["data/refill_short_groups"] = max(0, want - kept)
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

    def _sleep_engines(self) -> None:
        """The trainer gets the device (and memory) until the next weight sync."""
        if self.sleep_level:
            self.actor_infer.sleep(self.sleep_level)
            if self.sleep_level == 2:
                self.weight_sync.require_full()

    def update(
        self, step: int, batch: Batch, scores: torch.Tensor, metrics: dict[str, Any], timers: dict[str, float]
    ) -> None:
        """Reference and old log-probs, values, advantages, critic and actor updates, weight sync."""
        algo, pipe = self.cfg.algo, self.cfg.pipeline
        # 3. reference and old log-probs, values
        mask = batch["response_mask"].float()
        if self.reference is not None or self.reference_is_base:
            with timer(timers, "reference"):
                ref_group = self.reference or self.actor_train
                batch["ref_logprobs"] = ref_group.compute_logprobs(
                    batch, self.temperature, base=self.reference_is_base
                )["logprobs"]
        need_old = (
            algo.ppo_epochs > 1
            or self.mini_batches > 1
            or algo.off_policy_correction is not None
            or (algo.kl_in_reward and "ref_logprobs" in batch)
            or self.async_rollout is not None  # the proximal policy of decoupled PPO: the trainer's current one
        )
        if need_old:
            with timer(timers, "old_logprobs"):
                batch["old_logprobs"] = self.actor_train.compute_logprobs(batch, self.temperature)["logprobs"]
            metrics["actor/train_infer_logprob_diff"] = float(
                masked_mean((batch["old_logprobs"] - batch["behaviour_logprobs"]).abs(), mask)
            )
        if algo.off_policy_correction is not None:
            batch["is_weights"] = off_policy_weights(
                batch["old_logprobs"],
                batch["behaviour_logprobs"],
                mask,
                level=algo.off_policy_correction,
                cap=algo.off_policy_cap,
            )
        values = None
        if self.critic is not None:
            with timer(timers, "values"):
                values = self.critic.compute_values(batch)["values"]
            batch["values"] = values

        # 4. token rewards (KL in reward), advantages
        token_rewards = token_rewards_from_scores(scores, mask)
        if "ref_logprobs" in batch:
            policy_logp = batch["old_logprobs"] if "old_logprobs" in batch else batch["behaviour_logprobs"]
            kl = kl_estimate(policy_logp, batch["ref_logprobs"], algo.kl_kind) * mask
            metrics["actor/kl_to_ref"] = float(masked_mean(kl, mask))
            if algo.kl_in_reward:
                token_rewards = token_rewards - self.kl_ctl.value * kl
            self.kl_ctl.update(metrics["actor/kl_to_ref"], len(batch))
            metrics["actor/kl_coef"] = self.kl_ctl.value
            self.policy_objective.kl_loss_coef = 0.0 if algo.kl_in_reward else self.kl_ctl.value
        adv, returns = self._advantages(batch, scores, token_rewards, mask, values)
        if algo.whiten_advantages:
            adv = A.whiten(adv, mask)
        if algo.advantage_clip is not None:
            adv = adv.clamp(-algo.advantage_clip, algo.advantage_clip)
        batch["advantages"] = adv * mask
        metrics["actor/advantage_abs_mean"] = float(masked_mean(adv.abs(), mask))
        if returns is not None:
            batch["returns"] = returns

        # 5. critic and actor updates
        shuffle = pipe.seed * 7919 + step
        if self.critic is not None:
            with timer(timers, "train_critic"):
                metrics.update(
                    self.critic.train(
                        batch,
                        self.value_objective,
                        mini_batches=self.mini_batches,
                        epochs=algo.ppo_epochs,
                        temperature=1.0,
                        shuffle_seed=shuffle,
                    )
                )
        with timer(timers, "train_actor"):
            train_metrics = self.actor_train.train(
                batch,
                self.policy_objective,
                mini_batches=self.mini_batches,
                epochs=algo.ppo_epochs,
                temperature=self.temperature,
                shuffle_seed=shuffle,
            )
        metrics.update({k if "/" in k else f"actor/{k}": v for k, v in train_metrics.items()})
        self._check_finite(step, train_metrics)
        metrics["perf/train_tokens_per_s"] = float(mask.sum()) * algo.ppo_epochs / max(timers["train_actor"], 1e-9)
        # Token counts for FLOP accounting (bench/): generated tokens, and the batch's prompt tokens counted once
        # per group (what a shared-prompt forward needs).
        metrics["perf/response_tokens"] = float(mask.sum())
        p_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        metrics["perf/unique_prompt_tokens"] = float(batch["attention_mask"][:, :p_len].sum()) / algo.group_size

        # 6. weight sync train -> infer
        with timer(timers, "sync"):
            if self.sleep_level:
                self.actor_infer.wake_up()
            if self.async_rollout is not None:  # partial rollout aborts running requests, resumed after the sync
                self.async_rollout.begin_update()
            metrics.update(self.weight_sync.sync().metrics())
            if self.async_rollout is not None:
                self.async_rollout.finish_update()

    def _check_finite(self, step: int, train_metrics: dict[str, float]) -> None:
        """Count RL steps whose optimizer steps were skipped for NaN/inf; stop after too many in a row."""
        bad = train_metrics.get("nonfinite_steps", 0.0) > 0
        self.bad_steps = self.bad_steps + 1 if bad else 0
        limit = self.cfg.pipeline.max_nonfinite_steps
        if bad and limit and self.bad_steps >= limit:
            latest = self.ckpt.latest()
            raise FloatingPointError(
                f"step {step}: {self.bad_steps} steps in a row had a non-finite loss or gradient and were skipped "
                f"(pipeline.max_nonfinite_steps={limit}); lower algo.lr, check the rewards and data"
                + (f"; the last checkpoint is {latest} (pipeline.resume_from={latest})" if latest else "")
            )

    def _advantages(
        self,
        batch: Batch,
        scores: torch.Tensor,
        token_rewards: torch.Tensor,
        mask: torch.Tensor,
        values: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(advantages, returns or None), (B, R) each, from the configured `roll.algorithms` estimator."""
        return self.estimator(scores, token_rewards, mask, values, self.cfg.algo)

    # ---- set-up hooks (the agentic pipeline overrides them) -----------------------------------------------
    def _setup_data(self) -> None:
        """Training problems, held-out problems and the data sampler."""
        self.train_set, self.eval_set = self.task.train_set(), self.task.eval_set()[: self.cfg.pipeline.eval_size]
        if not self.train_set:
            raise ConfigError(f"env={self.cfg.env.name}: the training set is empty: check the data (env.path)")
        if self.cfg.pipeline.eval_every > 0 and not self.eval_set:
            raise ConfigError(
                f"pipeline.eval_every={self.cfg.pipeline.eval_every} but the held-out set of env={self.cfg.env.name} "
                f"is empty (pipeline.eval_size={self.cfg.pipeline.eval_size}): give it held-out problems "
                "(env.eval_size, env.eval_path) or set pipeline.eval_every=0"
            )
        self.sampler = PromptSampler(len(self.train_set), seed=self.cfg.pipeline.seed)

    def _setup_estimator(self) -> Any:
        """The advantage estimator: a `roll.algorithms` plugin (grpo, rloo, gae, ... or an installed one)."""
        if self.cfg.algo.adv_estimator == "gigpo":
            raise ConfigError("algo.adv_estimator=gigpo groups steps of multi-turn episodes: use pipeline=agentic")
        return registry.load("roll.algorithms", self.cfg.algo.adv_estimator)

    def _setup_reward(self) -> RewardGroup | None:
        """The reward role: workers that decode and score responses with the task's reward."""
        return self.cluster.group(
            RewardGroup,
            "reward",
            self.cfg.pipeline.reward_workers,
            env=as_dict(self.cfg.env),
            tokenizer_path=self.cfg.model.tokenizer or self.model_path,
            guard=self.cfg.pipeline.reward_guard(),  # errors, NaN and hangs become counted rows
        )

    # ---- pieces -------------------------------------------------------------------------------------------
    @property
    def eval_temperature(self) -> float:
        t = self.cfg.pipeline.eval_temperature
        return self.temperature if t is None else float(t)

    def _check_infer_engine(self, ie: dict[str, Any]) -> None:
        """Refuse sampling the engine cannot honour, and warn when prompt + response exceed its context."""
        try:
            self.actor_infer.check_sampling(self.sampling)
        except UnsupportedSamplingError as exc:
            raise ConfigError(f"infer_engine={ie['name']}: {exc}") from exc
        context = self.actor_infer.max_context_length()
        need = self.cfg.model.max_prompt_length + self.cfg.model.max_response_length
        if need > context:
            log.warning(
                "model.max_prompt_length + max_response_length = %d exceeds the %s engine's context of %d tokens: "
                "long prompts get shorter responses (finish reason 'length')",
                need,
                ie["name"],
                context,
            )

    def _prompt_batch(self, problems: list[Any], metrics: dict[str, Any]) -> Batch:
        """Prompts of `problems`. A draw whose every prompt is too long (a few huge data rows met by a small batch)
        draws again, as the asynchronous path does, up to one pass over the training set: a handful of bad rows
        never ends a run; each skip counts in data/skipped_long_prompts."""
        limit, skipped = self.cfg.model.max_prompt_length, 0
        for _ in range(math.ceil(len(self.train_set) / max(1, len(problems))) - 1):
            try:
                batch = prompt_batch(self.tokenizer, self.task, problems, limit, metrics)
            except PromptsTooLong:
                skipped += len(problems)
                problems = [self.train_set[i] for i in self.sampler.next(len(problems))]
                continue
            break
        else:  # the last draw raises when it fits no better, naming the limit
            batch = prompt_batch(self.tokenizer, self.task, problems, limit, metrics)
        metrics["data/skipped_long_prompts"] += skipped
        return batch

    def _log_samples(self, step: int, batch: Batch, scored: Batch, k: int = 2) -> None:
        texts = scored["response_text"]
        self.tracker.samples(
            step,
            [
                {
                    "problem": batch["problem_id"][i],
                    "answer": batch["answer"][i],
                    "response": texts[i],
                    "score": float(batch["scores"][i]),
                }
                for i in range(min(k, len(texts)))
            ],
        )

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy: one sample per held-out problem at the eval temperature."""
        t0 = time.perf_counter()
        res = evaluate(
            self.actor_infer,
            self.reward,
            self.tokenizer,
            self.task,
            self.eval_set,
            max_prompt_length=self.cfg.model.max_prompt_length,
            params=self.sampling.replace(temperature=self.eval_temperature, seed=self.cfg.pipeline.seed + 17),
        )
        return {
            "eval/accuracy": res["accuracy"],
            "eval/reward": res["reward"],
            "eval/seconds": time.perf_counter() - t0,
        }

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        tmp = self.ckpt.staging(step)
        self.actor_train.save(str(tmp / "actor"), self.cfg.model.tokenizer or self.model_path)
        if self.critic is not None:
            self.critic.save(str(tmp / "critic"), self.cfg.model.tokenizer or self.model_path)
        kl_state = self.kl_ctl.state_dict() if hasattr(self.kl_ctl, "state_dict") else {"value": self.kl_ctl.value}
        return self.ckpt.commit(
            tmp, step, {"sampler": self.sampler.state_dict(), "kl": kl_state, "experiment": self.cfg.experiment}
        )

    def _restore(self, folder: Path) -> None:
        state = self.ckpt.read_state(folder)
        self.actor_train.load(str(folder / "actor"))
        if self.critic is not None:
            self.critic.load(str(folder / "critic"))
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctl.value = state["kl"]["value"]
        self.start_step = state["step"] + 1
        self.tracker.truncate(state["step"])
        self.weight_sync.sync(full=True)
        log.info("resumed from %s at step %d", folder, self.start_step)

    def shutdown(self) -> None:
        if self.async_rollout is not None:
            self.async_rollout.close()
        self.tracker.close()  # a failed run's writer too: a restarted run reopens the same event files
        self.cluster.shutdown()
