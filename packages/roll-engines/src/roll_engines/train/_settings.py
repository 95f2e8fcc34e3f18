"""Configured optimizer settings survive a checkpoint load: a resumed run trains with the settings it was started
with now, at the schedule position the checkpoint reached.

`torch.optim.Optimizer.load_state_dict` restores every param group's hyperparameters as they were saved (lr,
weight decay, betas, eps), and `LambdaLR.load_state_dict` restores the base LRs; so a run resumed with a changed
`algo.lr` or `algo.weight_decay` silently kept the saved ones while its config.yaml said otherwise. An engine takes
`snapshot(optimizer)` before loading and calls `reapply(...)` after: the configured hyperparameters go back into the
param groups, the scheduler's base LRs become the configured ones, and the current LR is recomputed from the
scheduler's own multiplier (built from this run's `lr_schedule`, `warmup_steps`, `total_steps`) at the restored
step count. Adam's moments and step counts are kept; so is the scheduler's position, unless the run now takes another
number of optimizer steps per training step than the checkpoint's (`rebased`).

The schedule's position on resume (`rebased`): the LR schedule counts optimizer steps over a plan of
pipeline.max_steps x `optimizer_steps_per_step` (algo.ppo_epochs x mini-batches; the trainer passes both), and a
checkpoint records the count with the optimizer steps per training step it was taken at. A resume with another
number re-bases the count to as many training steps of the new plan (count x new / saved): where a run with the new
settings from its start would be, as a changed pipeline.max_steps alone keeps the count, a run of the new length's.
Adam's own per-parameter `step` (its bias correction) is not re-based: it counts the updates the moments really
took. A checkpoint without the record (written before roll kept it) keeps its count.

Covers torch optimizers and Megatron's (whose `param_groups` are the wrapped torch optimizer's). Does not cover
settings that change the optimizer's structure (a different optimizer class, LoRA on or off): those are refused by
roll_core.config.resume before anything loads.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: Param-group entries that come from the run's config (lr through `initial_lr`, which LambdaLR sets to the
#: configured lr when it is built); `lr` itself is recomputed from the schedule.
CONFIGURED_KEYS = ("initial_lr", "weight_decay", "betas", "eps")


def snapshot(optimizer: Any) -> list[dict[str, Any]]:
    """The configured hyperparameters of each param group, taken before a checkpoint overwrites them."""
    return [{k: group[k] for k in CONFIGURED_KEYS if k in group} for group in optimizer.param_groups]


def reapply(optimizer: Any, configured: list[dict[str, Any]], scheduler: Any = None) -> list[float]:
    """Put `configured` (from `snapshot`) back into the loaded optimizer; with a LambdaLR `scheduler`, make its
    base LRs the configured ones and set each group's LR to base x multiplier(restored step). Returns the LRs now
    in effect, one per param group."""
    groups = optimizer.param_groups
    if len(groups) != len(configured):
        raise ValueError(
            f"the checkpoint's optimizer has {len(groups)} param groups, this engine built {len(configured)}: "
            "it was saved by a differently configured engine (LoRA, critic or engine kind)"
        )
    for group, conf in zip(groups, configured):
        group.update(conf)
    if scheduler is None:
        return [float(g["lr"]) for g in groups]
    bases = [float(g.get("initial_lr", g["lr"])) for g in groups]
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(bases, scheduler.lr_lambdas)]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    # Through the scheduler's own state format, so get_last_lr() and the next step() agree with the groups.
    scheduler.load_state_dict({**scheduler.state_dict(), "base_lrs": bases, "_last_lr": lrs})
    return lrs


def rebased(count: int, saved_per_step: Any, per_step: int, who: str = "train engine", say: bool = True) -> int:
    """The schedule position to resume at: `count` (the checkpoint's optimizer-step count) taken at
    `saved_per_step` optimizer steps per training step, re-based to `per_step` (rounded down: exact when every
    training step took all its optimizer steps, none skipped as non-finite). `saved_per_step` None: `count`
    (a checkpoint from before roll recorded it). Logs (INFO, naming `who`) when the position moves, if `say` (one
    rank of a sharded engine says it).

    Raises:
        ValueError: either number of steps per training step is not a positive integer (a corrupt record).
    """
    if saved_per_step is None:
        return count
    for name, value in (("the checkpoint's", saved_per_step), ("this run's", per_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{who}: {name} optimizer steps per training step is {value!r}, not a positive integer")
    if saved_per_step == per_step:
        return count
    moved = count * per_step // saved_per_step
    if say:
        log.info(
            "%s: LR schedule re-based from optimizer step %d (%d per training step, the checkpoint's) to %d (%d per "
            "training step): where a run with these settings would be; Adam's step counts are kept",
            who,
            count,
            saved_per_step,
            moved,
            per_step,
        )
    return moved


def backend_for(device: Any) -> str:
    """The process-group backend for a train engine on `device`: gloo on CPU whatever accelerator the node has (a
    run with hw.platform=cpu on a GPU node opened an nccl group for CPU tensors: its first collective failed),
    else the platform's (nccl, hccl, ...)."""
    import torch

    if torch.device(device).type == "cpu":
        return "gloo"
    from roll_hw import current_platform

    return current_platform.dist_backend
