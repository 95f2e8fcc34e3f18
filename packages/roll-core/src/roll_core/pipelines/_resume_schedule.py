"""A resumed run whose settings change the optimizer steps a training step takes: where its LR schedule goes on.

The train engines' LR schedule (algo.warmup_steps, algo.lr_schedule over pipeline.max_steps x algo.ppo_epochs x
mini-batches optimizer steps: roll_core.pipelines.wiring.optimizer_schedule) counts optimizer steps, and a checkpoint
keeps that count. A resume that changes the optimizer steps per training step (algo.num_mini_batches,
algo.mini_batch_size, algo.ppo_epochs, or pipeline.rollout_batch_size with a mini_batch_size) takes effect, but the
saved count is then read against the new plan: 2 mini-batches -> 1 at step 5 of 10 under a cosine schedule puts the
schedule at its end (optimizer step 10 of 10), and the remaining steps trained at LR 0 with nothing said but an INFO
line listing the changed key. `schedule_shift` says so, as a warning naming where the schedule goes on, where a run
planned with the new settings would be and what the LR becomes. A changed pipeline.max_steps alone moves nothing:
the count is that of a run planned with the new length from its start.

May assume: `saved` is the checkpoint's config as a plain nested dict (roll_core.checkpoint.CheckpointManager
.read_config), `cfg` this run's typed config. The count is an estimate: steps that skipped every optimizer step
(non-finite) or trained nothing did not advance it, so the checkpoint's count is at most `step` x its steps per
training step.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from roll_core.checkpoint import CheckpointManager
from roll_core.pipelines.wiring import mini_batches

log = logging.getLogger(__name__)


def warn_schedule_shift(folder: Path, cfg: Any) -> str | None:
    """Log (WARNING) and return `schedule_shift`'s message for a resume from checkpoint `folder` under `cfg`; None
    (nothing logged) when the schedule keeps its place or the checkpoint records no config (an older roll's)."""
    saved = CheckpointManager.read_config(Path(folder))
    if saved is None:
        return None
    step = int(json.loads((Path(folder) / "state.json").read_text())["step"])
    message = schedule_shift(saved, cfg, step)
    if message is not None:
        log.warning("%s", message)
    return message


def optimizer_steps_per_step(cfg: Any) -> int:
    """Optimizer steps the schedule plans per training step: algo.ppo_epochs x mini-batches (`cfg`: a typed config
    or one whose groups are attribute namespaces)."""
    return int(cfg.algo.ppo_epochs) * mini_batches(cfg)


def schedule_shift(saved: Mapping[str, Any], cfg: Any, step: int) -> str | None:
    """A warning when resuming at checkpoint `step` under `cfg` moves the LR schedule off the position a run with
    `cfg`'s settings from the start would have (see the module docstring); None when it does not (same optimizer
    steps per training step, or a constant schedule whose warm-up is over either way).

    Args:
        saved: the checkpoint's config (a plain nested dict).
        cfg: this run's typed config.
        step: the checkpoint's training step.
    """
    try:
        old = optimizer_steps_per_step(_namespace(saved))
    except (AttributeError, KeyError, TypeError, ValueError):  # a config of another shape (an older roll's)
        return None
    new = optimizer_steps_per_step(cfg)
    if old == new:
        return None
    algo = cfg.algo
    done, planned = step * old, step * new  # the checkpoint's count (at most), a run planned so from the start
    total = int(cfg.pipeline.max_steps) * new
    warmup = int(algo.warmup_steps)
    if algo.lr_schedule == "constant" and min(done, planned) >= warmup:
        return None  # the LR is algo.lr at either position
    lr_now, lr_planned = (
        _multiplier(algo.lr_schedule, warmup, total, done),
        _multiplier(algo.lr_schedule, warmup, total, planned),
    )
    ended = algo.lr_schedule != "constant" and done >= total and total > warmup
    return (
        f"resumed at step {step} with {new} optimizer steps per training step (algo.ppo_epochs x mini-batches), "
        f"the checkpoint's {old}: the LR schedule (algo.lr_schedule={algo.lr_schedule}, algo.warmup_steps={warmup}) "
        f"counts optimizer steps and goes on from the checkpoint's count, up to {done} of {total}, where a run with "
        f"these settings from the start would be at {planned}: the LR is {lr_now:.3g} x algo.lr instead of "
        f"{lr_planned:.3g} x"
        + ("; the schedule has ended, so the remaining steps train at LR 0" if ended else "")
        + " (set algo.num_mini_batches, algo.mini_batch_size, algo.ppo_epochs and pipeline.rollout_batch_size back "
        "to keep the schedule)"
    )


def _multiplier(schedule: str, warmup: int, total: int, position: int) -> float:
    """The LR multiplier at optimizer step `position` (roll_engines.train._optim.lr_lambda's rule, which the hf,
    fsdp2 and megatron engines share; repeated here: roll_core does not import the engines)."""
    if warmup > 0 and position < warmup:
        return (position + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (position - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def _namespace(node: Any) -> Any:
    """A nested dict as attribute namespaces (what `mini_batches` reads)."""
    if isinstance(node, Mapping):
        return SimpleNamespace(**{str(k): _namespace(v) for k, v in node.items()})
    return node
