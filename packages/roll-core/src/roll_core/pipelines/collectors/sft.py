"""The SFT collector (`pipeline=sft`): batches of rows from files, for the `sft` objective.

Contract:
- Rows come from `data` (roll_core.posttrain `load_rows("sft", ...)`: chat messages, prompt/completion, token rows
  from a rollout-only output; `data.min_score` keeps only rollout samples that scored at least that: `min_score=1`
  on the 0/1 `correct` flag, SFT on correct samples; with `data.correct_key=null`, a threshold on the reward, e.g. a
  judge's score). Bad rows are counted skips (`data/skipped_rows`, the run summary's `skipped_rows` by reason, held-out
  file's included); training rows whose prompt `data.eval_path` holds too are kept and counted (`data/also_held_out`,
  the summary's `also_held_out`: roll_core.posttrain.source.PostTrainData, as RLVR reports its task's); no usable
  row, an empty file, a missing file are ConfigErrors before training starts.
- A step is `pipeline.rollout_batch_size` training rows drawn epoch by epoch in a seeded shuffle (a
  `PromptSampler`: the permutation of epoch e depends only on (pipeline.seed, e)); the state is the data position,
  so a resumed run draws exactly the rows of the uninterrupted run. The state also holds a fingerprint of the
  tokenised training rows (`rows_fingerprint`): resuming onto rows edited in place (same number, other rows or
  another order) is a warning, as the RLVR collectors' (the saved position then points at other rows); a
  checkpoint saved before the fingerprint existed resumes without the check. `data/epoch`: epochs drawn,
  fractional. Packing and token-budget micro-batches are the train engine's (`train_engine.pack_sequences`,
  `train_engine.micro_batch_tokens`).
- `on_policy = False`: nothing is sampled while training; the loop pushes the weights to the inference engines
  only before `evaluate`.
- `evaluate(step)`: `eval/sft_loss` (token-mean NLL of every held-out row, `data.eval_size` / `data.eval_path`,
  scored by the actor's train group without gradient) and, when `sft.eval_task` and the run's `env` task has
  held-out problems, the task's generation accuracy (`eval/accuracy`, `eval/reward`, `eval/n`: one sample per
  held-out problem at `pipeline.eval_temperature`, up to `pipeline.eval_size` problems, scored by a reward role
  built on first use), the same evaluation an RL run reports. The task's held-out problems beyond
  `pipeline.eval_size` are neither trained on nor evaluated: counted in `data/unused_held_out` and the summary's
  `unused_held_out` (roll_core.pipelines.collectors._eval_cut, as RLVR counts them).
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
import time
from array import array
from functools import cached_property
from typing import Any

import torch

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
from roll_core.pipelines.collectors.prompts import env_label
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.rollout import eval_log, evaluate
from roll_core.posttrain.pairs import Pair
from roll_core.posttrain.source import PostTrainData, RowSource, load_rows
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)


def _single_turn(task: Any) -> bool:
    from roll_core.interfaces.tasks import AgenticTask

    return not isinstance(task, AgenticTask)


def check(cfg: RLVRConfig, task: Any) -> None:
    """ConfigError for settings an SFT run cannot use, before any model loads."""
    if not cfg.data.paths:
        raise ConfigError("pipeline=sft reads rows from files: set data.path (a .jsonl/.json/.parquet/.csv file)")
    cfg.data.check_installed()
    if cfg.pipeline.async_ratio:
        raise ConfigError(
            f"pipeline.async_ratio={cfg.pipeline.async_ratio}: SFT generates nothing while training; set it to 0"
        )
    if cfg.sft.eval_task and cfg.pipeline.eval_every > 0 and not _single_turn(task):
        raise ConfigError(
            f"env={env_label(cfg)} is a multi-turn environment: an SFT run evaluates single-turn tasks only; set "
            "sft.eval_task=false (eval/sft_loss only) or a single-turn env (pipeline=agentic trains multi-turn "
            "environments by RL)"
        )


def rows_fingerprint(source: RowSource) -> str:
    """A hash of the training examples as tokenised, in order: each row's prompt ids, response ids and loss mask (a
    pair's chosen, then its rejected row). Built from token ids, never Python's `hash`, so it is the same in every
    process whatever PYTHONHASHSEED. Left out: where a row was read (a moved file holds the same rows) and
    per-token side data such as a teacher's top-k (the same examples; hashing it would cost a pass over (R, K)
    lists per row)."""
    h = hashlib.sha256()
    for item in source.items:
        for row in (item.chosen, item.rejected) if isinstance(item, Pair) else (item,):
            for ids in (row.prompt_ids, row.response_ids, row.mask):
                packed = array("q", ids)
                if sys.byteorder == "big":  # the same bytes on every machine a checkpoint may move to
                    packed.byteswap()
                h.update(len(packed).to_bytes(8, "little") + packed.tobytes())
    return h.hexdigest()[:16]


def warn_if_other_rows(state: dict[str, Any], fingerprint: str, size: int, what: str, logger: logging.Logger) -> None:
    """Log a warning when the checkpoint's rows fingerprint is not `fingerprint` (one saved before fingerprints
    existed has none and passes)."""
    saved = state.get("data")
    if saved is not None and saved != fingerprint:
        # Same size (the sampler refused another), other rows: a data file edited in place.
        logger.warning(
            "the training %s differ from those the checkpoint was saved with (same %d in number, not the same %s "
            "or order; fingerprint %s, saved %s): the saved data position applies to the new list, so some %s of "
            "this epoch may be repeated or skipped",
            what,
            size,
            what,
            fingerprint,
            saved,
            what,
        )


def read_rows(cfg: RLVRConfig, tokenizer: Any) -> PostTrainData:
    """The training and held-out rows of `data`, tokenised for the model's length limits."""
    return load_rows(
        "sft",
        cfg.data,
        tokenizer,
        max_prompt_length=cfg.model.max_prompt_length,
        max_response_length=cfg.model.max_response_length,
        seed=cfg.pipeline.seed,
    )


class SFTCollector:
    """Batches of SFT rows drawn by epoch (see the module docstring)."""

    plot_keys: tuple[str, ...] = ("sft/loss", "eval/sft_loss", "eval/accuracy")
    trajectories = False
    on_policy = False

    def __init__(self, ctx: CollectorContext, data: PostTrainData | None = None) -> None:
        cfg = ctx.cfg
        self.cfg, self.ctx = cfg, ctx
        data = data or read_rows(cfg, ctx.tokenizer)
        self.data = data  # (its skipped_rows and also_held_out are the run's data counts)
        self.train: RowSource = data.train
        self.held_out: RowSource | None = data.eval
        self.sampler = PromptSampler(len(self.train), seed=cfg.pipeline.seed, window=cfg.pipeline.rollout_batch_size)
        problems = ctx.task.eval_set() if cfg.sft.eval_task and _single_turn(ctx.task) else []
        # The task's held-out problems beyond pipeline.eval_size: neither trained nor evaluated (`_data_counts`); a
        # cut leaving a domain out is a warning when the run evaluates (eval_every=0 warned for nothing).
        self.eval_problems, self.eval_cut = first_eval_size(
            list(problems), cfg.pipeline.eval_size, evaluates=cfg.pipeline.eval_every > 0
        )
        self.reward: RewardGroup | None = None  # built on the first accuracy evaluation
        if cfg.pipeline.eval_every > 0 and self.held_out is None and not self.eval_problems:
            log.warning(
                "pipeline.eval_every=%d but nothing to evaluate: no held-out rows (data.eval_size, data.eval_path) "
                "and no held-out problems of env=%s (or sft.eval_task=false)",
                cfg.pipeline.eval_every,
                cfg.env.name,
            )
        log.info(
            "sft: %d training rows, %d held-out rows, %d held-out problems of env=%s; skipped %s, truncated %d",
            len(self.train),
            len(self.held_out or ()),
            len(self.eval_problems),
            cfg.env.name,
            self.train.skipped,
            self.train.truncated,
        )

    # ---- the collector contract ---------------------------------------------------------------------------
    def next(self, step: int, out: StepLog) -> Collected:
        """The next `pipeline.rollout_batch_size` rows (scores: 0; the SFT objective does not read them)."""
        with out.timer("data"):
            batch = self.train.batch(self.sampler.next(self.cfg.pipeline.rollout_batch_size))
        out["data/epoch"] = self.sampler.progress()
        out["data/rows"] = float(len(batch))
        out.update(data_metrics(self._data_counts()))  # data/skipped_rows, data/also_held_out, ...
        out["data/truncated_rows"] = float(self.train.truncated)
        lengths = batch["response_mask"].sum(-1).float()
        out["response/length_mean"] = float(lengths.mean())
        return Collected(batch, torch.zeros(len(batch)))

    def begin_sync(self) -> None:
        return None  # nothing runs between two steps

    def finish_sync(self, version: int) -> None:
        return None

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out NLL (`eval/sft_loss`) and the env task's held-out accuracy (see the module docstring)."""
        t0 = time.perf_counter()
        out: dict[str, float] = {}
        if self.held_out is not None and self.ctx.train is not None:
            out["eval/sft_loss"] = self.held_out_nll()
            out["eval/sft_ppl"] = math.exp(min(out["eval/sft_loss"], 80.0))
        if self.eval_problems:
            res = evaluate(
                # an engine's own abort is resumed, as RLVR's evaluation resumes it (not scored an engine failure)
                resuming(self.ctx.infer, self.ctx.tokenizer, self.cfg.pipeline.max_idle_aborts),
                self._reward(),
                self.ctx.tokenizer,
                self.ctx.task,
                self.eval_problems,
                max_prompt_length=self.cfg.model.max_prompt_length,
                template_kwargs=self.cfg.model.chat_template_kwargs,
                params=self.ctx.sampling.replace(
                    temperature=self.eval_temperature, seed=derive_seed(self.cfg.pipeline.seed, Purpose.EVAL)
                ),
            )
            out.update(eval_log(res))
        if out:
            out["eval/seconds"] = time.perf_counter() - t0
        return out

    def held_out_nll(self) -> float:
        """Token-mean NLL of every held-out row under the actor (no gradient), in chunks of rollout_batch_size."""
        assert self.held_out is not None and self.ctx.train is not None
        total, tokens = 0.0, 0.0
        n, size = len(self.held_out), max(self.cfg.pipeline.rollout_batch_size, 1)
        for start in range(0, n, size):
            batch = self.held_out.batch(range(start, min(start + size, n)))
            logp = self.ctx.train.compute_logprobs(batch, temperature=1.0)["logprobs"]
            mask = batch["response_mask"].to(torch.bool)
            total += float(-torch.where(mask, logp.float(), 0.0).sum())
            tokens += float(mask.sum())
        return total / tokens if tokens else math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "data": self._fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A resumed run over changed files would draw other rows: the sampler refuses another size or seed, the
        # fingerprint tells of other rows of the same number.
        self.sampler.load_state_dict(state["sampler"])
        warn_if_other_rows(state, self._fingerprint, len(self.train), "rows", log)

    def summary(self) -> dict[str, Any]:
        """How the files were read: rows skipped by reason, training rows also held out (`data_counts`), rows with turns
        of a role roll does not know, by role (`other_roles`: untrained context), rows whose roles were read through
        another data set's names, by rename (`renamed_roles`, "human->user"), responses truncated, rows trained and held
        out; the task's held-out problems beyond pipeline.eval_size in `unused_held_out` (`_data_counts`)."""
        return {
            **self._data_counts(),
            "other_roles": self.data.other_roles,
            "renamed_roles": self.data.renamed_roles,
            "truncated_rows": self.train.truncated + (self.held_out.truncated if self.held_out is not None else 0),
            "train_rows": len(self.train),
            "held_out_rows": len(self.held_out or ()),
        }

    def close(self) -> None:
        return None

    # ---- pieces -------------------------------------------------------------------------------------------
    def _data_counts(self) -> dict[str, Any]:
        """The data files' counts (`data_counts`) and, in `unused_held_out`, the env task's held-out problems
        beyond pipeline.eval_size (`eval_cut`: sampled for eval/accuracy, the rest neither trained nor evaluated)."""
        return with_eval_cut(self.data, getattr(self, "eval_cut", 0))

    @cached_property
    def _fingerprint(self) -> str:
        return rows_fingerprint(self.train)  # the training rows never change within a run

    @property
    def eval_temperature(self) -> float:
        t = self.cfg.pipeline.eval_temperature
        return self.ctx.sampling.temperature if t is None else float(t)

    def _reward(self) -> RewardGroup:
        """The env task's reward role (built once, on the first accuracy evaluation)."""
        if self.reward is None:
            cfg = self.cfg
            self.reward = self.ctx.cluster.group(
                RewardGroup,
                "reward",
                cfg.pipeline.reward_workers,
                env=as_dict(cfg.env),
                tokenizer_path=cfg.model.tokenizer or self.ctx.model_path,
                guard=cfg.pipeline.reward_guard(),
                chat_template_kwargs=cfg.model.chat_template_kwargs,  # as the prompts were rendered
            )
        return self.reward


#: `pipeline=sft`: rows from files, trained by the `sft` objective.
sft_collectors = FileRowsFactory("sft", check, read_rows, SFTCollector)
