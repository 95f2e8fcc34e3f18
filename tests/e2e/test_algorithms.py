"""Every algorithm preset runs a few steps on the tiny model; presets that promise clipping clip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from roll_core.config.search_path import group_options
from roll_core.testing import run_pipeline, tiny_overrides

PRESETS = sorted(group_options("algo"))  # roll-core's packaged algo/ (and any the repository's conf/ adds)
# The tiny model answers in <= 6 tokens: DAPO's overlong buffer must fit in that.
FIT = {"dapo": ["algo.overlong_buffer=2"]}


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_and_its_clipping_acts(preset: str, seven_task: Path, tmp_path: Path) -> None:
    _, history = run_pipeline(
        tiny_overrides(
            seven_task,
            tmp_path,
            f"algo={preset}",
            "algo.lr=1e-2",  # large steps: the second mini-batch's ratio moves far from 1
            "pipeline.max_steps=3",
            "pipeline.save_every=0",
            *FIT.get(preset, []),
        )
    )
    steps = [h for h in history if h["step"] > 0]
    assert len(steps) == 3
    # Every step's gradient is finite, and non-zero whenever its batch had a learning signal (non-zero
    # advantages), which at least one batch had: the preset's advantages reach the loss and the loss the weights.
    assert all(math.isfinite(h["actor/grad_norm"]) for h in steps), [h["actor/grad_norm"] for h in steps]
    signal = [h for h in steps if h["actor/advantage_abs_mean"] > 0]
    assert signal and all(h["actor/grad_norm"] > 0 for h in signal), [
        (h["actor/advantage_abs_mean"], h["actor/grad_norm"]) for h in steps
    ]
    if preset in ("dapo", "gspo", "ppo", "asyppo"):  # presets with several optimizer steps per batch
        clipped = max(h.get("actor/clipfrac_low", 0) + h.get("actor/clipfrac_high", 0) for h in steps)
        assert clipped > 0, f"{preset} never clipped"


def test_non_finite_losses_are_skipped_counted_and_stop_the_run(
    seven_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From step 3 the loss is NaN: those optimizer steps are skipped (weights and LR kept, counted), no checkpoint
    is written inside the streak, and the run stops with an explanation naming the last healthy checkpoint after
    pipeline.max_nonfinite_steps of them in a row."""
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing import run_pipeline, tiny_overrides

    calls = {"n": 0}
    real = PolicyObjective.__call__

    def sometimes_nan(self: PolicyObjective, outputs: dict, micro: dict) -> tuple:
        loss, m = real(self, outputs, micro)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > 2 else loss), m

    monkeypatch.setattr(PolicyObjective, "__call__", sometimes_nan)
    overrides = tiny_overrides(seven_task, tmp_path, "algo.warmup_steps=10", "pipeline.save_every=1")
    with pytest.raises(FloatingPointError, match="3 steps in a row had a non-finite loss") as err:
        run_pipeline([*overrides, "train_engine.micro_batch_size=64", "pipeline.max_nonfinite_steps=3"])
    # The message names the last checkpoint saved before the streak; none was written inside it (its weights could
    # hold the blow-up, and resuming from it would fail again).
    assert "pipeline.resume_from=" in str(err.value) and "step_000002" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    from roll_core.tracking import Tracker

    h = Tracker.read_metrics(tmp_path / "metrics.jsonl")
    # step 5, the one that stops the run, is logged too (it raised before its record was written)
    assert [r["actor/nonfinite_steps"] for r in h] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert [r["actor/optimizer_steps"] for r in h] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert h[1]["actor/lr"] > h[0]["actor/lr"] and h[4]["actor/lr"] == h[3]["actor/lr"] == h[2]["actor/lr"]
    assert h[4]["step"] == 5 and h[4]["reward/mean"] is not None


def test_steps_whose_other_mini_batches_trained_are_not_a_non_finite_streak(
    seven_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One mini-batch of two is NaN in every step: it is skipped and counted, the other trains, the run finishes
    and checkpoints (a streak counts steps whose optimizer steps were all skipped)."""
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing import run_pipeline, tiny_overrides

    calls = {"n": 0}
    real = PolicyObjective.__call__

    def every_other_nan(self: PolicyObjective, outputs: dict, micro: dict) -> tuple:
        loss, m = real(self, outputs, micro)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] % 2 == 0 else loss), m

    monkeypatch.setattr(PolicyObjective, "__call__", every_other_nan)
    overrides = tiny_overrides(seven_task, tmp_path, "pipeline.save_every=1", "pipeline.max_steps=4")
    _, h = run_pipeline([*overrides, "train_engine.micro_batch_size=64", "algo.num_mini_batches=2"])
    steps = [r for r in h if r["step"] > 0]
    assert [(r["actor/nonfinite_steps"], r["actor/optimizer_steps"]) for r in steps] == [(1.0, 1.0)] * 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "step_000004"
