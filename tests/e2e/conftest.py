"""Shared fixtures of the end-to-end tests: one Ray instance per session, a tiny learnable task, a run helper."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from roll_core.testing import constant_answer_task


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance per test module that needs it (Ray takes 10-15 s to start here)."""
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(
        address="local",  # a new instance even when another cluster runs on this machine
        num_cpus=8,
        include_dashboard=False,
        namespace="roll-tests",
        ignore_reinit_error=True,
        # Workers import test helpers the way the controller does (env.env=py:agentic_toy:<Class>).
        runtime_env={
            "env_vars": {
                "ROLL_CACHE_DIR": os.environ["ROLL_CACHE_DIR"],
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p
                ),
            }
        },
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def seven_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A task a random tiny model learns within a few steps: every answer is 7."""
    return constant_answer_task(tmp_path_factory.mktemp("data") / "seven.jsonl")


@pytest.fixture(scope="session")
def tiny_model(_model_cache: None) -> str:
    """Path of the built-in tiny model (built once per session into the cache)."""
    from roll_core.models import resolve_model_path

    return resolve_model_path("builtin:tiny")
