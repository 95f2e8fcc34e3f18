"""fp16's loss scaler skipping every step: each overflow halves the scale and skips the optimizer step, and a gradient
that overflows fp16 at any scale skipped every step of the run for ever (logged at info, counted in
actor/scaler_skipped_steps, never stopping: those skips are not non-finite steps). Now the engines report the
streak (`*/scaler_skip_streak_max`), the trainer keeps the longest of its roles', and pipeline.max_loss_scale_skips
optimizer steps in a row (default 32: the scale from 2^16 to 2^-16) stop the run naming the cause, the stopping
step logged first. The trainer and loop run for real; the objective and tracker are stand-ins."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.config.schema import PipelineConfig
from roll_core.pipelines.loop import Pipeline
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.trainer import Trainer


class _Objective:
    """Writes what an fp16 engine reports: `skips[i]` of `steps` optimizer steps skipped by the scaler at step i+1,
    the streak carried across steps as the engine carries it."""

    def __init__(self, skips: list[int], steps: int, role: str = "actor") -> None:
        self.skips, self.steps, self.role, self.streak = skips, steps, role, 0

    def update(self, step: int, collected: Any, out: StepLog) -> None:
        n = self.skips[step - 1]
        longest = 0
        for i in range(self.steps):
            skipped = i >= self.steps - n  # a step's skipped optimizer steps come last here
            self.streak = self.streak + 1 if skipped else 0
            longest = max(longest, self.streak if skipped else 0)
        out.update(
            {f"{self.role}/scaler_skipped_steps": float(n), f"{self.role}/optimizer_steps": float(self.steps - n)}
        )
        out.update({f"{self.role}/nonfinite_steps": 0.0, f"{self.role}/scaler_skip_streak_max": float(longest)})


def _trainer(objective: _Objective) -> Trainer:
    t = Trainer.__new__(Trainer)  # the real update and streak counting; no roles, engines or weight sync
    t.roles, t.objective = SimpleNamespace(actor_train=object()), objective
    t.sleep_level, t.asleep, t.stale, t.bad_steps, t.scaler_streak = 0, False, False, 0, 0
    return t


def _pipeline(trainer: Trainer, limit: int) -> Pipeline:
    p = Pipeline.__new__(Pipeline)
    p.cfg = SimpleNamespace(pipeline=SimpleNamespace(max_nonfinite_steps=3, max_loss_scale_skips=limit))
    p.trainer, p.healthy_checkpoint = trainer, None
    p.logged = []  # type: ignore[attr-defined]
    p.tracker = SimpleNamespace(log=lambda step, out: p.logged.append(step))  # type: ignore[attr-defined]
    return p


def _run(p: Pipeline, steps: int) -> int:
    """Steps run until the loop's check raised (re-raised) or `steps` finished; returns the last step."""
    for step in range(1, steps + 1):
        out = StepLog()
        p.trainer.update(step, None, out)  # type: ignore[arg-type]
        p._check_finite(step, out)
    return steps


def test_every_step_overflowing_stops_the_run_after_the_limit_naming_the_cause() -> None:
    assert PipelineConfig().max_loss_scale_skips == 32
    p = _pipeline(_trainer(_Objective([1] * 100, steps=1)), limit=32)
    with pytest.raises(FloatingPointError) as info:
        _run(p, 100)
    msg = str(info.value)
    assert msg.startswith("step 32: fp16's loss scaler skipped 32 optimizer steps in a row")
    assert "pipeline.max_loss_scale_skips=32" in msg and "model.dtype=bfloat16" in msg
    assert p.logged == [32]  # the stopping step's metrics are logged before the error


def test_the_streak_counts_optimizer_steps_across_steps_and_a_taken_step_resets_it() -> None:
    # 4 optimizer steps a step: 4 + 4 skipped in a row, then a step that took two (the streak restarts) and skipped
    # two, then 4 + 4: 14 in a row at step 6 (without the reset: 14 at step 4)
    objective = _Objective([4, 4, 2, 4, 4, 4], steps=4)
    p = _pipeline(_trainer(objective), limit=12)
    with pytest.raises(FloatingPointError, match=r"^step 6: .* skipped 14 optimizer steps in a row"):
        _run(p, 6)
    # a critic's scaler counts too (AsyPPO's critic_<m>/ alike)
    p = _pipeline(_trainer(_Objective([3, 3], steps=3, role="critic_1")), limit=6)
    with pytest.raises(FloatingPointError, match=r"^step 2: "):
        _run(p, 2)


def test_a_warm_up_below_the_limit_and_limit_zero_never_stop() -> None:
    # the scaler's own warm-up: 16 overflows from 2^16 to a scale of 1, then it trains
    assert _run(_pipeline(_trainer(_Objective([1] * 16 + [0] * 4, steps=1)), limit=32), 20) == 20
    assert _run(_pipeline(_trainer(_Objective([1] * 40, steps=1)), limit=0), 40) == 40
    with pytest.raises(ValueError, match="max_loss_scale_skips"):
        PipelineConfig(max_loss_scale_skips=-1)
