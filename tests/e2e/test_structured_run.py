"""Structured outputs in an RL run: every rollout matches the constraint, and the trainer's recomputed log-probs
are those of the same constrained distribution (the PPO ratio compares one policy with itself); a train engine that
cannot recompute them is refused before anything starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from roll_core.errors import ConfigError
from roll_core.testing import constant_answer_task, run_pipeline, tiny_overrides

REGEX = "[0-9]{1,5}"


def test_constrained_rollouts_and_matching_trainer_logprobs(tmp_path: Path) -> None:
    data = constant_answer_task(tmp_path / "seven.jsonl")
    out = tmp_path / "run"
    _, history = run_pipeline(
        tiny_overrides(
            data,
            out,
            "pipeline.max_steps=2",
            f"+infer_engine.structured.regex='{REGEX}'",
            "algo.off_policy_correction=token",  # the trainer recomputes old log-probs and compares them
        )
    )
    steps = [h for h in history if h["step"] > 0 and "reward/mean" in h]
    assert len(steps) == 2
    # A random tiny model samples digits only; without the mask the trainer's log-probs would be off by ~1 nat.
    assert all(h["actor/train_infer_logprob_diff"] < 1e-5 for h in steps), steps
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(re.fullmatch(REGEX, s["response"]) for s in samples), samples


def test_a_train_engine_that_cannot_replay_the_constraint_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    data = constant_answer_task(tmp_path / "seven.jsonl")
    with pytest.raises(ConfigError, match="train_engine=megatron cannot"):
        run_pipeline(
            tiny_overrides(data, tmp_path / "m", "train_engine=megatron", f"+infer_engine.structured.regex='{REGEX}'")
        )
