"""Shared fixtures of the end-to-end tests: one Ray instance per session, a tiny learnable task, a run helper."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from roll_core.config import load_config
from roll_core.tracking import Tracker


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for every test that needs it (Ray takes 10-15 s to start here)."""
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        namespace="roll-tests",
        ignore_reinit_error=True,
        runtime_env={"env_vars": {"ROLL_CACHE_DIR": os.environ["ROLL_CACHE_DIR"]}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def seven_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A task a random tiny model can learn within a few steps: every answer is 7 (credit: last number is 7)."""
    path = tmp_path_factory.mktemp("data") / "seven.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: say 7", "answer": "7"}) + "\n" for i in range(200)))
    return path


def tiny_overrides(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "model=tiny",
        "model.max_response_length=6",
        "env=file",
        f"env.path={data}",
        "env.reward.last_number_weight=1.0",
        "env.eval_size=16",
        "algo.group_size=8",
        "algo.lr=3e-3",
        "pipeline.rollout_batch_size=4",
        "pipeline.max_steps=20",
        "pipeline.eval_every=0",
        "pipeline.progress=false",
        f"pipeline.output_dir={out}",
        "train_engine.micro_batch_size=16",
        *extra,
    ]


def run(overrides: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run a pipeline in this process; returns (summary, metrics history)."""
    from roll_core.pipelines.rlvr import RLVRPipeline

    cfg = load_config(overrides)
    pipeline = RLVRPipeline(cfg)
    try:
        summary = pipeline.run()
    finally:
        pipeline.shutdown()
    return summary, Tracker.read_metrics(Path(cfg.pipeline.output_dir) / "metrics.jsonl")


def rewards(history: list[dict[str, Any]]) -> list[float]:
    return [h["reward/mean"] for h in history if h["step"] > 0 and "reward/mean" in h]
