"""Reward-model scoring inside a collector: build the `reward_model` role and mix its scores into the task's.

`build_reward_model(ctx)` returns None for `reward_model=none`; otherwise it checks the model (a missing path, or a
model that is not a sequence classifier with one label, is a ConfigError before the run starts), creates the role
through the cluster and returns a `RewardModelScoring`. After the task reward scored a batch, a collector calls
`scoring.apply(batch, scored, out)`: every row's (prompt_text, response_text) is scored by the role (with the
conversation the policy saw, `prompt_messages`, where the batch has it: the chat template renders all of it), the raw
scores are normalised (`none`; `batch`: z-score within the training batch; `running`: z-score by the running mean
and variance of all scores seen, updated first with this batch) and `scored["scores"]` becomes, in place, the
normalised score (`mode=replace`) or task score + weight x normalised score (`mode=add`). A training batch may be
scored in several calls (dynamic sampling's refill rounds, the asynchronous collector's chunks): with `batch`, each
call also returns its rows' task and raw model scores (`RM_ROW_TENSORS`) and the collector calls
`renormalise(batch)` on the assembled batch, so that every row is normalised by the same batch statistics (a
refill round of two groups was standardised against itself: the same raw score became +0.45 in one round and -1.0
in the next).

Evaluation (`apply(batch, scored, None)`, or `apply(..., out, update=False)`) normalises by the TRAINING
statistics, never by the evaluated batch's own: with `running` and with `batch` alike, the running mean and
variance of every score the model gave in training so far (with `batch` they are gathered too, for evaluation
only; each training batch is still standardised by itself). Standardising the eval batch against itself made
`eval/reward` exactly 0 (`mode=replace`) or the task reward plus 0 (`mode=add`) for a bad policy and a good one
alike. Before any training batch (a step-0 evaluation) there are no statistics: the evaluated batch's own stand in.
The reference moves as training goes on; `eval/reward_model/raw_mean` (the model's own scale) is the number to
compare across evaluations.

Metrics (into `out`): `reward_model/raw_mean`, `raw_std` (the model's logits), `score_mean`, `score_std` (after
normalisation), `truncated` and `nonfinite` (rows), `running_mean` and `running_std` (modes running and batch:
the statistics evaluation normalises by); the caller times the call. An evaluation's are the same names under
`eval/reward_model/`, into `out` when given, else kept for `take_eval_metrics()` (the collector adds them to its
eval log). A non-finite model score (a half-precision overflow) is counted, left out of the statistics, and given
the mean normalised score of the batch's other rows (no advantage either way); it never fails the step.
`state_dict()` holds the running statistics (a resumed run continues them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import MutableMapping
from typing import Any, Protocol

import torch

from roll_core.config.reward_model import RewardModelConfig
from roll_core.pipelines.sampling import RM_ROW_TENSORS
from roll_core.protocol import Batch

log = logging.getLogger(__name__)


class Scorer(Protocol):
    """What scores rows: roll_core.cluster.reward_model.RewardModelGroup."""

    def score(self, batch: Batch) -> Batch: ...


class RunningStats:
    """Count, mean and sum of squared deviations of every value seen (Chan et al.'s parallel update: exact for
    any batch sizes, stable in float64)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        """Add `values` (N,) to the statistics."""
        n = int(values.numel())
        if n == 0:
            return
        v = values.double()
        mean, m2 = float(v.mean()), float(((v - v.mean()) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def var(self) -> float:
        """Population variance of the values seen (0 before two values)."""
        return self.m2 / self.count if self.count > 1 else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def zscore(values: torch.Tensor, mean: float, var: float, eps: float) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps), float32."""
    return ((values.double() - mean) / math.sqrt(var + eps)).float()


def combine(task: torch.Tensor, rm: torch.Tensor, mode: str, weight: float) -> torch.Tensor:
    """The row scores (B,) float32: `rm` (replace) or `task + weight * rm` (add)."""
    if mode == "replace":
        return rm.float().clone()
    if mode == "add":
        return (task.float() + weight * rm.float()).float()
    raise ValueError(f"reward_model.mode={mode!r} is not replace or add")


class RewardModelScoring:
    """Scores rows with the reward-model role and mixes them into the task reward (see the module docstring)."""

    def __init__(self, cfg: RewardModelConfig, scorer: Scorer) -> None:
        self.cfg, self.scorer = cfg, scorer
        self.stats = RunningStats()
        self.totals = {"rows": 0, "truncated": 0, "nonfinite": 0}
        self._eval_metrics: dict[str, float] = {}

    def normalise(self, raw: torch.Tensor, *, update: bool) -> torch.Tensor:
        """(B,) float32 training scores of the finite `raw` scores (B,), per `cfg.normalize`: `batch` by `raw`'s own
        statistics, `running` by the running ones; `update` (a training call) adds `raw` to the running statistics
        first (with `batch` too: they are evaluation's reference). `renormalise` calls it with `update=False`."""
        mode, eps = self.cfg.normalize, self.cfg.eps
        if mode == "none" or raw.numel() == 0:
            return raw.float().clone()
        if update:
            self.stats.update(raw)
        if mode == "batch" or self.stats.count == 0:
            return zscore(raw, float(raw.double().mean()), float(raw.double().var(unbiased=False)), eps)
        return zscore(raw, self.stats.mean, self.stats.var, eps)

    def normalise_eval(self, raw: torch.Tensor) -> torch.Tensor:
        """(B,) float32 evaluation scores of the finite `raw` scores (B,): z-scored by the training statistics
        (read, not updated; see the module docstring), by `raw`'s own before any training batch; `none`: as
        they are."""
        if self.cfg.normalize == "none" or raw.numel() == 0:
            return raw.float().clone()
        if self.stats.count == 0:
            return zscore(raw, float(raw.double().mean()), float(raw.double().var(unbiased=False)), self.cfg.eps)
        return zscore(raw, self.stats.mean, self.stats.var, self.cfg.eps)

    def take_eval_metrics(self) -> dict[str, float]:
        """The `eval/reward_model/...` metrics of the last evaluation call made without an `out`, then forgotten
        (so that a later evaluation that scored nothing reports none rather than stale ones)."""
        metrics, self._eval_metrics = self._eval_metrics, {}
        return metrics

    def apply(
        self, batch: Batch, scored: Batch, out: MutableMapping[str, Any] | None, *, update: bool | None = None
    ) -> None:
        """Score `batch["prompt_text"]` x `scored["response_text"]` and replace `scored["scores"]` (B,) in place by
        the mix of `cfg.mode`; metrics to `out` when given. `update` (default: whether `out` is given, so that
        evaluation's `apply(batch, scored, None)` leaves the running statistics alone) updates the running
        statistics and the totals; a call that does not update is an evaluation: normalised by the training
        statistics (`normalise_eval`), its metrics under `eval/reward_model/`, kept for `take_eval_metrics` when
        `out` is None."""
        update = out is not None if update is None else update
        if out is None and not update:
            out = self._eval_metrics = {}
        prefix = "reward_model/" if update else "eval/reward_model/"
        rows = Batch(fields={"prompt_text": batch["prompt_text"], "response_text": scored["response_text"]})
        if "prompt_messages" in batch:  # system prompt and earlier turns: the reward model sees the policy's prompt
            rows["prompt_messages"] = batch["prompt_messages"]
        res = self.scorer.score(rows)
        raw, cut = res["rm_scores"].float(), res["rm_truncated"]
        finite = torch.isfinite(raw)
        norm = torch.zeros_like(raw)
        norm[finite] = self.normalise(raw[finite], update=True) if update else self.normalise_eval(raw[finite])
        bad = int((~finite).sum())
        if bad:
            # Neutral: the mean of the batch's other rows, so the broken row gets no advantage either way.
            norm[~finite] = float(norm[finite].mean()) if bool(finite.any()) else 0.0
            log.warning("reward model: %d of %d scores were not finite (counted in %snonfinite)", bad, len(raw), prefix)
        if update and self.cfg.normalize == "batch":  # the step's batch may come in several calls: renormalise
            scored["task_scores"], scored["rm_raw"] = scored["scores"].float().clone(), raw.clone()
        scored["scores"] = combine(scored["scores"], norm, self.cfg.mode, self.cfg.weight)
        if update:
            self.totals["rows"] += len(raw)
            self.totals["truncated"] += int(cut.sum())
            self.totals["nonfinite"] += bad
        if out is None:
            return
        ok = raw[finite]
        out[prefix + "raw_mean"] = float(ok.mean()) if len(ok) else float("nan")
        out[prefix + "raw_std"] = float(ok.std(unbiased=False)) if len(ok) else 0.0
        out[prefix + "score_mean"] = float(norm.mean()) if len(norm) else float("nan")
        out[prefix + "score_std"] = float(norm.std(unbiased=False)) if len(norm) else 0.0
        # Counts add up over the calls of one step (dynamic sampling scores several rounds); means are the last's.
        out[prefix + "truncated"] = out.get(prefix + "truncated", 0.0) + float(cut.sum())
        out[prefix + "nonfinite"] = out.get(prefix + "nonfinite", 0.0) + float(bad)
        if self.cfg.normalize in ("running", "batch"):
            out[prefix + "running_mean"] = self.stats.mean
            out[prefix + "running_std"] = math.sqrt(self.stats.var)

    def renormalise(self, batch: Batch) -> Batch:
        """`batch` (a step's assembled training batch) with `scores` (B,) recomputed from its rows' task and raw
        model scores normalised over the whole batch (normalize=batch; see the module docstring), without the
        RM_ROW_TENSORS fields; any other batch is returned as it is."""
        if not all(k in batch for k in RM_ROW_TENSORS):
            return batch
        raw = batch["rm_raw"].float()
        finite = torch.isfinite(raw)
        norm = torch.zeros_like(raw)
        norm[finite] = self.normalise(raw[finite], update=False)
        norm[~finite] = float(norm[finite].mean()) if bool(finite.any()) else 0.0
        batch["scores"] = combine(batch["task_scores"], norm, self.cfg.mode, self.cfg.weight)
        return batch.select(*(k for k in batch.keys() if k not in RM_ROW_TENSORS))

    def state_dict(self) -> dict[str, Any]:
        """The running statistics and row totals (what a resumed run continues)."""
        return {"stats": self.stats.state_dict(), "totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats.load_state_dict(state["stats"])
        self.totals.update(state.get("totals", {}))

    def summary(self) -> dict[str, int]:
        """Rows scored in training, and of them rows cut to max_length and rows whose score was not finite."""
        return dict(self.totals)

    def close(self) -> None:
        """Nothing to stop: the role's workers end with the cluster (which owns every group)."""
        return None


def build_reward_model(ctx: Any) -> RewardModelScoring | None:
    """The run's reward-model scoring (`ctx`: a roll_core.pipelines.collectors.CollectorContext), or None for
    `reward_model=none`. Raises ConfigError, before any worker starts, for a model that is missing or is not a
    sequence classifier with one label, or for `template=chat` with a tokenizer that has no chat template."""
    cfg: RewardModelConfig | None = getattr(ctx.cfg, "reward_model", None)
    if cfg is None or not cfg.enabled:
        return None
    from roll_core.cluster.reward_model import RewardModelGroup, check_reward_model

    path = check_reward_model(cfg.path, trust_remote_code=cfg.trust_remote_code, tokenizer=cfg.tokenizer)
    tokenizer = cfg.tokenizer
    if tokenizer is not None:
        from roll_core.models import resolve_model_path

        tokenizer = resolve_model_path(tokenizer)
    _check_template(cfg, tokenizer or path)
    placement = cfg.placement or ctx.cfg.cluster.placement
    offload = cfg.offload
    if offload is None:  # device memory is the trainer's between scoring calls when the devices are shared
        offload = placement == "colocated" and ctx.cluster.platform.device_type != "cpu"
    group = ctx.cluster.group(
        RewardModelGroup,
        "reward_model",
        cfg.world_size,
        placement=placement,
        path=path,
        tokenizer=tokenizer,
        template=cfg.template,
        batch_size=cfg.batch_size,
        max_length=cfg.max_length,
        truncation_side=cfg.truncation_side,
        dtype=cfg.dtype,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
        offload=offload,
        platform=ctx.cluster.platform.name,
    )
    return RewardModelScoring(cfg, group)


def _check_template(cfg: RewardModelConfig, tokenizer_path: str) -> None:
    from roll_core.config.reward_model import CHAT_TEMPLATE
    from roll_core.errors import ConfigError

    if cfg.template != CHAT_TEMPLATE:
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=cfg.trust_remote_code)
    if not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"reward_model.template=chat but the tokenizer of {tokenizer_path} has no chat template: give a text "
            "template, e.g. reward_model.template='{prompt}\\n{response}'"
        )
