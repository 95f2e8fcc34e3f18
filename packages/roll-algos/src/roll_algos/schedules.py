"""Learning-rate schedules: the multiplier of the base LR at an optimizer step (plain python, no torch needed).

With W = `warmup_steps`, T = `total_steps` and s the optimizer step (0 = the first update):

| schedule | s < W (W > 0) | s >= W, T > W, with p = min(1, (s - W) / (T - W)) |
|---|---|---|
| `constant` | (s + 1) / W | 1 |
| `linear` | (s + 1) / W | 1 - p |
| `cosine` | (s + 1) / W | 0.5 (1 + cos(pi p)) |

A run no longer than its warm-up (T <= W) stays at 1 after it; past T the decaying schedules stay at their end (0).
The one rule of roll's train engines (hf, fsdp2, Megatron: roll_engines.train._optim.lr_lambda) and of the driver
that says where a resumed run's schedule goes on (roll_core.pipelines._resume_schedule). An unknown schedule is a
ValueError up front (`check_lr_schedule`), whatever the step: the multiplier reads it only past the warm-up.
"""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "check_lr_schedule", "lr_multiplier"]

#: The LR schedules after the warm-up (roll's algo.lr_schedule).
LR_SCHEDULES = ("constant", "cosine", "linear")


def check_lr_schedule(schedule: str) -> None:
    """Raise a ValueError naming the choices when `schedule` is not one of `LR_SCHEDULES` (names are exact:
    "Linear" is refused)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")


def lr_multiplier(schedule: str, warmup_steps: int, total_steps: int, step: int) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based): linear warm-up over `warmup_steps` steps
    ((step + 1) / warmup_steps), then `schedule` ("constant", "linear" or "cosine" decay to 0 at `total_steps`,
    held there after); see the module docstring's table. An unknown `schedule` is a ValueError at any step."""
    check_lr_schedule(schedule)
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress  # linear
