"""The DPO collector (`pipeline=dpo`): batches of preference pairs read from files, for the `dpo` objective.

Contract: the pairs come from `data` (roll_core.posttrain: `{prompt, chosen, rejected}` rows, or pairs built from a
rollout-only output file, `data.format=rollout`), tokenised once at start. A step takes `pipeline.rollout_batch_size`
pairs in a per-epoch order seeded by `pipeline.seed` (roll_core.data.PromptSampler: its position is checkpointed,
so a resumed run takes the pairs the uninterrupted run would; with it the checkpoint holds a fingerprint of the
tokenised training pairs, and resuming onto pairs edited in place, same number, is a warning as in the RLVR
collectors; a checkpoint without one resumes unchecked). `data/epoch`: epochs drawn, fractional; `data/skipped_rows`
(bad rows of both files) and `data/also_held_out` (training pairs whose prompt `data.eval_path` holds too, kept) are
in every step and in the run summary (`skipped_rows` by reason, `also_held_out`) as RLVR reports its task's
(roll_core.posttrain.source.PostTrainData); `pair_stats` keeps the pair-building counts. Its batch holds
2N rows, pair i's chosen at row 2i and its rejected at 2i+1 (`pair_index`, `is_chosen`), and `row_id` = 2 x the
pair's index in the data + (0 chosen, 1 rejected): the objective's reference cache key. Scores are 1 for chosen
rows, 0 for rejected ones. It does not sample from the policy (`on_policy = False`): the weights reach the
inference engines only before evaluations.

Evaluation: the held-out pairs (`data.eval_path`, or `data.eval_size` pairs held out of `data.path`) scored by the
actor (`ctx.train`): eval/dpo_accuracy (pairs whose implicit reward margin is > 0), eval/dpo_loss (as dpo/loss:
the preference loss + dpo.sft_weight x eval/dpo_nll), eval/dpo_preference_loss, eval/dpo_nll and
eval/dpo_margin, against reference log-probs computed when the collector is built, i.e. by the actor's initial
weights (the reference: the model the run starts from; with LoRA its base, adapters off) before any update or
checkpoint restore; and, with `dpo.generate_eval`, one sample per held-out problem of the env task
(eval/accuracy, as the RL pipelines report it; reward workers are started only then): up to `pipeline.eval_size`
problems, the rest counted in `data/unused_held_out` and the summary's `unused_held_out` (as RLVR counts them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch

from roll_algos.preference import preference_loss
from roll_core.cluster.roles import RewardGroup
from roll_core.config.build import as_dict
from roll_core.config.schema import RLVRConfig
from roll_core.data import PromptSampler
from roll_core.errors import ConfigError
from roll_core.interfaces.tasks import data_metrics
from roll_core.pipelines.collectors import Collected, CollectorContext
from roll_core.pipelines.collectors._eval_cut import first_eval_size, with_eval_cut
from roll_core.pipelines.collectors._resume import resuming
from roll_core.pipelines.collectors.file_rows import FileRowsFactory
from roll_core.pipelines.collectors.sft import rows_fingerprint, warn_if_other_rows
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.dpo import pair_arguments, summed
from roll_core.pipelines.rollout import eval_log, evaluate
from roll_core.posttrain.source import PostTrainData, RowSource, load_rows
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)

#: `data.format` values that give preference pairs.
PAIR_FORMATS = ("auto", "preference", "rollout")


def _generates(cfg: RLVRConfig, task: Any) -> bool:
    """Whether evaluations sample the env task's held-out problems."""
    return bool(cfg.dpo.generate_eval and cfg.pipeline.eval_every > 0 and task.eval_set()[: cfg.pipeline.eval_size])


def check(cfg: RLVRConfig, task: Any) -> None:
    """Data files given, a pair form, something to evaluate when the run evaluates (before any model loads)."""
    from roll_core.interfaces.tasks import AgenticTask
    from roll_core.pipelines.collectors import refuse_async

    refuse_async(cfg, "dpo", "trains on pairs it does not generate while training")
    data = getattr(cfg, "data", None)
    if data is None or not data.paths:
        raise ConfigError(
            "pipeline=dpo trains on preference pairs: set data.path=pairs.jsonl ({prompt, chosen, rejected} rows), "
            "or data.path=<rollout-only output> data.format=rollout"
        )
    if data.format not in PAIR_FORMATS:
        raise ConfigError(f"data.format={data.format!r} cannot feed pipeline=dpo: use one of {', '.join(PAIR_FORMATS)}")
    data.check_installed()
    if cfg.dpo.generate_eval and cfg.pipeline.eval_every > 0 and isinstance(task, AgenticTask):
        raise ConfigError(
            f"dpo.generate_eval samples single-turn held-out problems; env={cfg.env.name} is multi-turn: "
            "set dpo.generate_eval=false (the held-out pairs are still scored)"
        )
    if cfg.pipeline.eval_every > 0 and not (data.eval_paths or data.eval_size or _generates(cfg, task)):
        raise ConfigError(
            f"pipeline.eval_every={cfg.pipeline.eval_every} but there is nothing to evaluate: hold out pairs "
            "(data.eval_path or data.eval_size), or give the env task held-out problems with dpo.generate_eval=true, "
            "or set pipeline.eval_every=0"
        )


def read_pairs(cfg: RLVRConfig, tokenizer: Any) -> PostTrainData:
    """The training and held-out pairs of `data`, tokenised for the model's length limits."""
    return load_rows(
        "preference",
        cfg.data,
        tokenizer,
        max_prompt_length=cfg.model.max_prompt_length,
        max_response_length=cfg.model.max_response_length,
        seed=cfg.pipeline.seed,
    )


class DPOCollector:
    """Preference pairs from files, step by step (see the module docstring)."""

    plot_keys: tuple[str, ...] = ("dpo/loss", "dpo/reward_accuracy", "eval/dpo_accuracy", "eval/accuracy")
    trajectories = False
    on_policy = False

    def __init__(self, ctx: CollectorContext, data: PostTrainData | None = None) -> None:
        cfg = ctx.cfg
        check(cfg, ctx.task)
        self.cfg, self.ctx = cfg, ctx
        data = data if data is not None else read_pairs(cfg, ctx.tokenizer)
        self.data = data  # (its skipped_rows and also_held_out are the run's data counts)
        self.train_pairs: RowSource = data.train
        self.eval_pairs: RowSource | None = data.eval if ctx.train is not None else None
        log.info(
            "dpo: %d training pairs, %d held-out pairs (%s)",
            len(self.train_pairs),
            len(data.eval) if data.eval is not None else 0,
            ", ".join(f"{k}={v}" for k, v in {**self.train_pairs.stats, **self.train_pairs.skipped}.items()) or "-",
        )
        self.sampler = PromptSampler(
            len(self.train_pairs), seed=cfg.pipeline.seed, window=cfg.pipeline.rollout_batch_size
        )
        self.eval_batch: Batch | None = None
        self.eval_ref: torch.Tensor | None = None
        if self.eval_pairs is not None:
            self.eval_batch = self.eval_pairs.batch(range(len(self.eval_pairs)))
            if cfg.dpo.uses_reference:
                # The actor holds the initial weights here (built before any update or restore): the reference.
                base = bool(cfg.train_engine.lora_rank)
                logp = ctx.train.compute_logprobs(self.eval_batch, 1.0, base=base)["logprobs"]
                self.eval_ref = summed(logp, self.eval_batch["response_mask"])
        self.reward: RewardGroup | None = None
        self.eval_set: Sequence[Any] = []
        # The task's held-out problems beyond pipeline.eval_size: neither trained nor evaluated (`_data_counts`).
        self.eval_cut = 0
        if _generates(cfg, ctx.task):
            self.eval_set, self.eval_cut = first_eval_size(ctx.task.eval_set(), cfg.pipeline.eval_size)
            self.reward = ctx.cluster.group(
                RewardGroup,
                "reward",
                cfg.pipeline.reward_workers,
                env=as_dict(cfg.env),
                tokenizer_path=cfg.model.tokenizer or ctx.model_path,
                guard=cfg.pipeline.reward_guard(),
                chat_template_kwargs=cfg.model.chat_template_kwargs,  # as the prompts were rendered
            )

    # ---- the collector contract ---------------------------------------------------------------------------
    def next(self, step: int, out: StepLog) -> Collected:
        """The next `pipeline.rollout_batch_size` pairs as 2N rows (chosen, rejected interleaved)."""
        idx = self.sampler.next(self.cfg.pipeline.rollout_batch_size)
        batch = self.train_pairs.batch(idx)
        pair_ids = torch.tensor(idx, dtype=torch.long).repeat_interleave(2)
        batch["row_id"] = 2 * pair_ids + (~batch["is_chosen"]).long()
        out["data/epoch"] = self.sampler.progress()
        out["data/pairs"] = float(len(idx))
        out.update(data_metrics(self._data_counts()))  # data/skipped_rows, data/also_held_out, ...
        out["response/length_mean"] = float(batch["response_mask"].sum(-1).float().mean())
        return Collected(batch, batch["is_chosen"].float())

    def begin_sync(self) -> None:
        return None  # nothing is generated between steps

    def finish_sync(self, version: int) -> None:
        return None

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out pairs' preference accuracy and loss; the env task's held-out accuracy with generate_eval."""
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        if self.eval_batch is not None:
            out.update(self._pair_eval())
        if self.reward is not None:
            sampling = self.ctx.sampling
            t = self.cfg.pipeline.eval_temperature
            res = evaluate(
                # an engine's own abort is resumed, as RLVR's evaluation resumes it (not scored an engine failure)
                resuming(self.ctx.infer, self.ctx.tokenizer, self.cfg.pipeline.max_idle_aborts),
                self.reward,
                self.ctx.tokenizer,
                self.ctx.task,
                self.eval_set,
                max_prompt_length=self.cfg.model.max_prompt_length,
                template_kwargs=self.cfg.model.chat_template_kwargs,
                params=sampling.replace(
                    temperature=sampling.temperature if t is None else float(t),
                    seed=derive_seed(self.cfg.pipeline.seed, Purpose.EVAL),
                ),
            )
            out.update(eval_log(res))
        out["eval/seconds"] = time.perf_counter() - t0
        return out

    def _pair_eval(self) -> dict[str, float]:
        d, batch = self.cfg.dpo, self.eval_batch
        assert batch is not None and self.ctx.train is not None
        mask = batch["response_mask"]
        seq = summed(self.ctx.train.compute_logprobs(batch, 1.0)["logprobs"], mask)
        lengths = mask.sum(-1).float()
        ref = self.eval_ref
        loss, m = preference_loss(**pair_arguments(d, seq, ref, lengths))
        # The training objective's terms (dpo/loss, dpo/preference_loss, dpo/nll): with dpo.sft_weight > 0 (RPO)
        # eval/dpo_loss left out the NLL term and was not the quantity dpo/loss is.
        nll = -float(seq[0::2].sum()) / max(float(lengths[0::2].sum()), 1.0)
        return {
            "eval/dpo_accuracy": float(m["reward_accuracy"]),
            "eval/dpo_loss": float(loss.mean()) + d.sft_weight * nll,
            "eval/dpo_preference_loss": float(loss.mean()),
            "eval/dpo_nll": nll,
            "eval/dpo_margin": float(m["reward_margin"]),
            "eval/dpo_pairs": float(len(batch) // 2),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "data": self._fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])  # (refuses a training set of another size or seed)
        warn_if_other_rows(state, self._fingerprint, len(self.train_pairs), "pairs", log)

    @cached_property
    def _fingerprint(self) -> str:
        return rows_fingerprint(self.train_pairs)  # the training pairs never change within a run

    def summary(self) -> dict[str, Any]:
        """How the files were read: pairs, skipped rows by reason and training pairs also held out
        (`data_counts`), pairs with turns of a role roll does not know, by role (`other_roles`: untrained context),
        pairs whose roles were read through another data set's names, by rename (`renamed_roles`, "human->user"),
        truncated responses, pair-building counts; with dpo.generate_eval, the task's held-out problems beyond
        pipeline.eval_size in `unused_held_out` (`_data_counts`)."""
        src = self.train_pairs
        return {
            "pairs": len(src),
            "held_out_pairs": len(self.eval_pairs) if self.eval_pairs is not None else 0,
            **self._data_counts(),
            "other_roles": self.data.other_roles,
            "renamed_roles": self.data.renamed_roles,
            "truncated_responses": src.truncated,
            **({"pair_stats": dict(src.stats)} if src.stats else {}),
        }

    def close(self) -> None:
        return None

    def _data_counts(self) -> dict[str, Any]:
        """The data files' counts (`data_counts`) and, in `unused_held_out`, the env task's held-out problems
        beyond pipeline.eval_size (`eval_cut`: sampled for eval/accuracy, the rest neither trained nor evaluated)."""
        return with_eval_cut(self.data, getattr(self, "eval_cut", 0))


#: `pipeline=dpo`: preference pairs from files, trained by the `dpo` objective.
dpo_collectors = FileRowsFactory("dpo", check, read_pairs, DPOCollector)
