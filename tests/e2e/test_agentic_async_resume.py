"""A resumed asynchronous agentic run (`pipeline=agentic pipeline.async_ratio=1`) logs the run's weight version.

`async/version` is the weight version a step's batch was taken under: step s of a run that syncs once per step
takes its batch at version s - 1. The collector counted syncs since its own start, so a run resumed after step 2
logged 0 at step 3 (the uninterrupted run 2), as the prompts collector did before its fix
(packages/roll-core/tests/test_async_version_resume.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from roll_core.testing import run_pipeline

sys.path.insert(0, str(Path(__file__).parent))  # agentic_toy: env=py:agentic_toy:<Class>
from agentic_toy import SAY_DIGIT_OVERRIDES


def _overrides(out: Path, *extra: str) -> list[str]:
    return [
        *SAY_DIGIT_OVERRIDES,
        "env.eval_size=4",
        "algo=grpo",
        "algo.group_size=4",
        "algo.lr=1e-2",
        "pipeline.rollout_batch_size=2",
        "pipeline.async_ratio=1",
        "algo.off_policy_correction=token",
        "pipeline.eval_every=0",
        "pipeline.progress=false",
        f"pipeline.output_dir={out}",
        "train_engine.micro_batch_size=16",
        *extra,
    ]


def test_a_resumed_async_agentic_run_logs_the_runs_weight_version(tmp_path: Path) -> None:
    run_pipeline(_overrides(tmp_path, "pipeline.max_steps=2"))
    saved = json.loads((tmp_path / "checkpoints" / "step_000002" / "state.json").read_text())
    _, history = run_pipeline(_overrides(tmp_path, "pipeline.max_steps=4", "pipeline.resume=true"))
    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2, 3, 4]  # each step logged once
    assert [h["async/version"] for h in steps] == [0.0, 1.0, 2.0, 3.0]  # read 0.0, 1.0 after the resume
    # The staleness bound is in the resumed process's own count: a fresh batch after the resume, then at most k.
    assert steps[2]["async/staleness_max"] == 0.0 and steps[3]["async/staleness_max"] <= 1.0
    assert saved["collector"]["version"] == 2  # two weight syncs: the run's version at the checkpoint
    final = json.loads((tmp_path / "checkpoints" / "step_000004" / "state.json").read_text())
    assert final["collector"]["version"] == 4 and final["trainer"]["version"] == 4
