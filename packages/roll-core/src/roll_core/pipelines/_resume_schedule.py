"""A resumed run whose settings change the optimizer steps a training step takes: the LR schedule is re-based.

The train engines' LR schedule (algo.warmup_steps, algo.lr_schedule over pipeline.max_steps x algo.ppo_epochs x
mini-batches optimizer steps: roll_core.pipelines.wiring.optimizer_schedule) counts optimizer steps, and a checkpoint
keeps that count with the optimizer steps per training step it was taken at (the engines' runtime key
`optimizer_steps_per_step`). A resume that changes that number (algo.num_mini_batches, algo.mini_batch_size,
algo.ppo_epochs, or pipeline.rollout_batch_size with a mini_batch_size) has every train engine, actor and critics
alike, re-base the count to as many training steps of the new plan (roll_engines.train._settings.rebased): the run
goes on where a run with the new settings from its start would be, as a changed pipeline.max_steps alone keeps the
count (a run planned with the new length). Before, the saved count was read against the new plan: 2 mini-batches ->
1 at step 5 of 10 under a cosine schedule put the schedule at its end and the remaining steps trained at LR 0.
`schedule_rebase` says so in one INFO line (from -> to, the LR it gives). Adam's own step counts (its bias
correction) are not re-based: they count the updates the moments took.

May assume: `saved` is the checkpoint's config as a plain nested dict (roll_core.checkpoint.CheckpointManager
.read_config), `cfg` this run's typed config. The "from" count is an estimate: steps that skipped every optimizer
step (non-finite) or trained nothing did not advance it, so the checkpoint's count is at most `step` x its steps per
training step (the engines scale the count they hold). A checkpoint written before the engines recorded their steps
per training step keeps its count (the engines cannot tell what it was counted at).
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


def log_schedule_rebase(folder: Path, cfg: Any) -> str | None:
    """Log (INFO) and return `schedule_rebase`'s message for a resume from checkpoint `folder` under `cfg`; None
    (nothing logged) when the schedule keeps its place or the checkpoint records no config (an older roll's)."""
    saved = CheckpointManager.read_config(Path(folder))
    if saved is None:
        return None
    step = int(json.loads((Path(folder) / "state.json").read_text())["step"])
    message = schedule_rebase(saved, cfg, step)
    if message is not None:
        log.info("%s", message)
    return message


def optimizer_steps_per_step(cfg: Any) -> int:
    """Optimizer steps the schedule plans per training step: algo.ppo_epochs x mini-batches (`cfg`: a typed config
    or one whose groups are attribute namespaces)."""
    return int(cfg.algo.ppo_epochs) * mini_batches(cfg)


def schedule_rebase(saved: Mapping[str, Any], cfg: Any, step: int) -> str | None:
    """A line saying where the LR schedule goes on when resuming at checkpoint `step` under `cfg`: re-based from the
    checkpoint's optimizer-step count to `step` x this run's optimizer steps per training step (see the module
    docstring); None when the count stays (same optimizer steps per training step, or a config of another shape).

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
    lr = _multiplier(algo.lr_schedule, warmup, total, planned)
    return (
        f"resumed at step {step} with {new} optimizer steps per training step (algo.ppo_epochs x mini-batches), "
        f"the checkpoint's {old}: the train engines re-base the LR schedule (algo.lr_schedule={algo.lr_schedule}, "
        f"algo.warmup_steps={warmup}) from the checkpoint's optimizer step {done} to {planned} of {total}, where a run "
        f"with these settings from the start would be (LR {lr:.3g} x algo.lr); Adam's step counts are kept"
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
