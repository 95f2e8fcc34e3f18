"""Step metrics shared by the pipelines: a step's log (metrics and phase timers) and reward/response statistics
of a scored batch."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from roll_core.protocol import Batch


class timer:
    """Context manager adding elapsed seconds to timers[name]."""

    def __init__(self, timers: dict[str, float], name: str) -> None:
        self.timers, self.name = timers, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.timers[self.name] = self.timers.get(self.name, 0.0) + time.perf_counter() - self.t0


class StepLog(dict):  # type: ignore[type-arg]
    """One step's metrics (a dict of name -> value) and its phase timers (`timers`: seconds per phase)."""

    def __init__(self) -> None:
        super().__init__()
        self.timers: dict[str, float] = {}

    def timer(self, name: str) -> timer:
        """Context manager adding the block's seconds to `timers[name]`."""
        return timer(self.timers, name)


def reward_metrics(batch: Batch, scored: Batch, lengths: torch.Tensor, max_len: int) -> dict[str, float]:
    s = batch["scores"]
    out = {
        "reward/mean": float(s.mean()),
        "reward/std": float(s.std()) if len(s) > 1 else 0.0,
        "reward/accuracy": float(batch["correct"].mean()),
        "reward/format": float(batch["formatted"].mean()),
        "response/length_mean": float(lengths.float().mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_ratio": float(batch["truncated"].float().mean()),
    }
    for k, v in scored.meta.get("reward_counters", {}).items():
        out[f"reward/{k}"] = float(v)
    if not math.isfinite(out["reward/mean"]):
        raise FloatingPointError("reward is not finite: check the reward function")
    return out


def row_domains(batch: Batch) -> list[str] | None:
    """Each row's domain (from its `metadata`), or None when the batch carries none."""
    if "metadata" not in batch:
        return None
    domains = [m.get("domain") for m in batch["metadata"]]
    return None if any(d is None for d in domains) else [str(d) for d in domains]


def domain_metrics(batch: Batch, lengths: torch.Tensor, max_len: int, domains: list[str]) -> dict[str, float]:
    """Per-domain reward, accuracy, format rate, response length, truncation and share of rows:
    `domain/<d>/<name>`, for each of `domains` that has rows in `batch` (a multi-domain run)."""
    rows = row_domains(batch)
    if rows is None:
        return {}
    out: dict[str, float] = {}
    for d in domains:
        idx = torch.tensor([i for i, r in enumerate(rows) if r == d], dtype=torch.long)
        if len(idx) == 0:
            continue
        out[f"domain/{d}/reward"] = float(batch["scores"][idx].mean())
        out[f"domain/{d}/accuracy"] = float(batch["correct"][idx].mean())
        out[f"domain/{d}/format"] = float(batch["formatted"][idx].mean())
        out[f"domain/{d}/length_mean"] = float(lengths[idx].float().mean())
        out[f"domain/{d}/clip_ratio"] = float(batch["truncated"][idx].float().mean())
        out[f"domain/{d}/share"] = len(idx) / len(rows)
    return out


def trained_domain_shares(batch: Batch, domains: list[str]) -> dict[str, float]:
    """`domain/<d>/trained_share`: each of `domains`' share of the rows the step trains on (0 for a domain with
    none). `domain/<d>/share` is the sampled mix (env.counts / env.weights); dynamic sampling
    (algo.drop_uniform_groups) drops groups without reward variance and refills by the same mix, so a domain whose
    groups are all solved or all failed shrinks in (or vanishes from) the trained batch, which nothing showed."""
    rows = row_domains(batch)
    if not rows:
        return {}
    return {f"domain/{d}/trained_share": sum(r == d for r in rows) / len(rows) for d in domains}


#: A masking correction dropping more than this fraction of the response tokens trains on too little to learn from.
HEAVY_MASKING = 0.5


def heavy_masking_warning(out: dict[str, float], correction: str | None) -> str | None:
    """The line to log when a step's masking correction (`actor/correction/masked_fraction`) dropped more than
    HEAVY_MASKING of the tokens, naming the band to widen; None otherwise. Measured: geo_mask's default band
    (0.999..1.001) drops ~95 % of a bf16 CPU rollout's sequences and the reward falls (bench/RESULTS.md)."""
    frac = out.get("actor/correction/masked_fraction")
    if frac is None or not frac > HEAVY_MASKING:
        return None
    p5, p95 = out.get("actor/correction/ratio_p5"), out.get("actor/correction/ratio_p95")
    spread = f" (ratio p5..p95 {p5:.4f}..{p95:.4f})" if p5 is not None and p95 is not None else ""
    return (
        f"algo.off_policy_correction={correction} masked {frac:.0%} of the response tokens{spread}: the update "
        "trains on few tokens; widen the band (algo.correction_low / algo.correction_high) or use icepop"
    )
