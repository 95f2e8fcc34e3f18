"""Engine plugins: an out-of-tree engine with its config (tests/plugins/roll-dummy-engine) is discovered, composes
as `infer_engine=recompute`, passes the conformance suite and runs the pipeline; the conformance suite also runs
over every installed inference engine, and an unknown engine name lists what is installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from roll_core import registry
from roll_core.config import ConfigError, compose, load_config
from roll_core.testing.infer_engine import InferEngineTestSuite

pytest.importorskip("roll_dummy_engine", reason="install tests/plugins/roll-dummy-engine (nox does)")


class TestEveryInstalledInferEngine(InferEngineTestSuite):
    """The suite over each `roll.infer_engines` entry point; engines that cannot start here skip with the reason."""

    @pytest.fixture(scope="class", params=registry.available("roll.infer_engines"))
    @classmethod
    def engine(cls, request: pytest.FixtureRequest, model_path: str):
        engine_cls = registry.load("roll.infer_engines", request.param)
        try:
            eng = engine_cls(model_path, max_new_tokens=16, seed=0)
        except ImportError as exc:  # e.g. vllm lives in its own venv, sglang needs a GPU
            pytest.skip(f"infer engine {request.param!r} cannot start in this environment: {exc}")
        yield eng
        eng.shutdown()


def test_plugin_engine_and_config_are_discovered() -> None:
    assert "recompute" in registry.available("roll.infer_engines")
    cfg = load_config(["infer_engine=recompute"])
    assert type(cfg.infer_engine).__name__ == "RecomputeInferEngineConfig" and cfg.infer_engine.name == "recompute"
    with pytest.raises(ConfigError, match=r"(?s)Key 'tempreature'.*Did you mean 'infer_engine.temperature'"):
        load_config(["infer_engine=recompute", "infer_engine.tempreature=0.5"])


def test_unknown_engine_lists_installed_ones() -> None:
    with pytest.raises(ConfigError, match=r"(?s)Installed infer_engine plugins.*recompute: roll_dummy_engine"):
        compose(["infer_engine=recomptue"])
    with pytest.raises(ConfigError, match="Did you mean 'infer_engine=recompute'"):
        compose(["infer_engine=recomptue"])


def test_doctor_lists_the_plugin(doctor_output: str) -> None:
    line = next(ln for ln in doctor_output.splitlines() if ln.startswith("inference engines"))
    assert "recompute (roll-dummy-engine)" in line and "hf (roll-engines)" in line


def test_pipeline_runs_with_the_plugin_engine(seven_task: Path, tmp_path: Path) -> None:
    from roll_core.testing import run_pipeline, tiny_overrides

    _, history = run_pipeline(tiny_overrides(seven_task, tmp_path, "infer_engine=recompute", "pipeline.max_steps=2"))
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["actor/train_infer_logprob_diff"] < 1e-4 for h in history)  # the plugin samples exactly


@pytest.fixture(scope="module")
def seven_task(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import os

    from roll_core.testing import constant_answer_task

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return constant_answer_task(tmp_path_factory.mktemp("data") / "seven.jsonl")


def test_async_training_with_a_synchronous_only_engine_is_a_config_error(seven_task: Path, tmp_path: Path) -> None:
    from roll_core.testing import run_pipeline, tiny_overrides

    with pytest.raises(ValueError, match="infer_engine=recompute is synchronous-only"):
        run_pipeline(tiny_overrides(seven_task, tmp_path, "infer_engine=recompute", "pipeline.async_ratio=1"))
