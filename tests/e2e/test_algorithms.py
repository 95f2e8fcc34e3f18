"""Every algorithm preset runs a few steps on the tiny model; presets that promise clipping clip."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.testing import run_pipeline, tiny_overrides

CONF = Path(__file__).resolve().parents[2] / "conf" / "algo"
PRESETS = sorted(p.stem for p in CONF.glob("*.yaml"))
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
    assert len(steps) == 3 and all(h["actor/grad_norm"] >= 0 for h in steps)
    if preset in ("dapo", "gspo", "ppo"):  # presets with several optimizer steps per batch
        clipped = max(h.get("actor/clipfrac_low", 0) + h.get("actor/clipfrac_high", 0) for h in steps)
        assert clipped > 0, f"{preset} never clipped"
