"""A multi-domain RLVR run on the tiny model: fixed per-domain counts in every batch, each domain's reward, metrics
and held-out accuracy per domain, per-domain panels in curves.png, and the per-domain advantage scale."""

from __future__ import annotations

import json
from pathlib import Path

from roll_core.testing import constant_answer_task, run_pipeline, tiny_overrides


def _overrides(tmp: Path, seven: Path, out: str, *extra: str) -> list[str]:
    three = tmp / "three.jsonl"
    three.write_text("".join(json.dumps({"prompt": f"B{i}: say 3", "answer": "3"}) + "\n" for i in range(100)))
    base = [o for o in tiny_overrides(seven, tmp / out, "pipeline.max_steps=2") if not o.startswith("env")]
    return [
        *base,
        "env=multi",
        "~env@env.tasks.math",
        "~env@env.tasks.code",
        "~env@env.tasks.instruct",
        "+env@env.tasks.seven=file",
        f"env.tasks.seven.path={seven}",
        "env.tasks.seven.eval_size=8",
        "env.tasks.seven.reward.last_number_weight=1.0",
        "+env@env.tasks.three=file",
        f"env.tasks.three.path={three}",
        "env.tasks.three.eval_size=8",
        "env.tasks.three.reward.last_number_weight=1.0",
        "+env.counts.seven=3",
        "+env.counts.three=1",
        *extra,
    ]


def test_multi_domain_run_reports_every_domain(tmp_path: Path) -> None:
    seven = constant_answer_task(tmp_path / "seven.jsonl")
    _, history = run_pipeline(_overrides(tmp_path, seven, "run", "pipeline.eval_every=2"))
    steps = [h for h in history if h["step"] > 0 and "reward/mean" in h]
    assert len(steps) == 2
    for h in steps:
        # env.counts: 3 of the 4 prompts per batch are "seven"'s, every step.
        assert h["domain/seven/share"] == 0.75 and h["domain/three/share"] == 0.25
        # Without dynamic sampling the rows trained on are the rows sampled.
        assert h["domain/seven/trained_share"] == 0.75 and h["domain/three/trained_share"] == 0.25
        for d in ("seven", "three"):
            for k in ("reward", "accuracy", "format", "length_mean", "clip_ratio"):
                assert f"domain/{d}/{k}" in h
        # Every row reached its domain's reward with its metadata: nothing failed to score.
        assert h["reward/failed_rows"] == 0 and h["reward/unknown_domain"] == 0
        # The batch mean is the share-weighted mean of the domains' means.
        mixed = 0.75 * h["domain/seven/reward"] + 0.25 * h["domain/three/reward"]
        assert abs(mixed - h["reward/mean"]) < 1e-5
    evals = [h for h in history if "eval/accuracy" in h]
    assert evals and all(h["eval/seven/n"] == 8 and h["eval/three/n"] == 8 for h in evals)
    last = evals[-1]
    assert abs(last["eval/accuracy"] - (last["eval/seven/accuracy"] + last["eval/three/accuracy"]) / 2) < 1e-6
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert all(s["domain"] in ("seven", "three") for s in samples)
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0


def test_advantage_scale_zero_silences_a_domain(tmp_path: Path) -> None:
    seven = constant_answer_task(tmp_path / "seven.jsonl")
    plain = run_pipeline(_overrides(tmp_path, seven, "plain", "pipeline.max_steps=1", "pipeline.eval_every=0"))[1]
    scaled = run_pipeline(
        _overrides(
            tmp_path,
            seven,
            "scaled",
            "pipeline.max_steps=1",
            "pipeline.eval_every=0",
            "+env.advantage_scale.seven=0",
            "+env.advantage_scale.three=0",
        )
    )[1]
    first = next(h for h in plain if h["step"] == 1)
    assert first["actor/advantage_abs_mean"] > 0  # the same rollouts (same seed) carry a signal unscaled
    assert next(h for h in scaled if h["step"] == 1)["actor/advantage_abs_mean"] == 0.0
