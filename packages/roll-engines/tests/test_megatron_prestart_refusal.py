"""A model train_engine=megatron cannot convert is refused while the pipeline is built, before the cluster starts
(roll_core.pipelines.wiring.check_train_models asks the engine config, MegatronTrainEngineConfig.check_model, which
reads the model folder's config.json alone): the engine's set-up refused it only once Ray had started and its
workers had spawned and imported Megatron. Each test stops the build where the cluster would start, so nothing
runs; the refusal names the key that gave the model (model.path, algo.critic_model_path). Models the engine can
train, other engines, and hub ids (not read here: the engine checks what it downloads) reach the cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from roll_core.errors import ConfigError


class _ClusterStarted(Exception):
    """Raised where the pipeline would start its cluster (Ray, on a cluster=ray run)."""


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`build(*overrides)`: build a pipeline up to its cluster's start; raises what the build raised before it, or
    _ClusterStarted."""
    from roll_core.cli import pipeline_class
    from roll_core.config import load_config
    from roll_core.pipelines import loop

    def cluster(*_: Any, **__: Any) -> None:
        raise _ClusterStarted

    monkeypatch.setattr(loop, "Cluster", cluster)
    monkeypatch.setenv("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    runs = iter(range(100))

    def run(*overrides: str) -> None:
        out = tmp_path / f"run{next(runs)}"
        cfg = load_config([f"pipeline.output_dir={out}", "pipeline.progress=false", *overrides])
        pipeline_class(cfg.pipeline.name)(cfg)

    return run


@pytest.fixture
def folder(tmp_path: Path, tiny_hf_config: Any):
    """`folder(name, cls, **change)`: a model folder holding the config.json of `tiny_hf_config(cls, **change)` alone
    (no weights: nothing else is read before the cluster starts)."""

    def write(name: str, cls: str, **change: Any) -> Path:
        path = tmp_path / name
        tiny_hf_config(cls, **change).save_pretrained(path)
        return path

    return write


def test_a_model_megatron_cannot_convert_is_refused_before_the_cluster_starts(build, folder) -> None:
    mistral = folder("mistral", "MistralConfig", sliding_window=8)
    want = rf"model\.path={mistral}: train_engine=megatron maps .* model_type='mistral'"
    with pytest.raises(ConfigError, match=want):
        build("train_engine=megatron", f"model.path={mistral}")


def test_the_layout_is_checked_against_the_model_before_the_cluster_starts(build, folder) -> None:
    qwen2 = folder("qwen2", "Qwen2Config")  # 2 key/value heads
    layout = ["train_engine=megatron", "train_engine.world_size=4", "train_engine.tensor_parallel_size=4"]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 must divide the model's 2 key/value heads"):
        build(*layout, f"model.path={qwen2}")


def test_a_critic_model_megatron_cannot_convert_names_its_key(build, folder) -> None:
    gemma = folder("gemma", "GemmaConfig")
    with pytest.raises(ConfigError, match=rf"algo\.critic_model_path={gemma}: .* model_type='gemma'"):
        build("train_engine=megatron", "model=tiny", "algo=ppo", f"algo.critic_model_path={gemma}")


@pytest.mark.parametrize(
    "overrides",
    [
        ["train_engine=megatron", "model=tiny"],  # a model it converts
        ["train_engine=hf", "model.path={mistral}"],  # another engine: any transformers model
        ["train_engine=megatron", "model.path=nobody-here/not-downloaded"],  # a hub id: the engine checks it
    ],
    ids=["megatron-llama", "hf-mistral", "megatron-hub-id"],
)
def test_what_may_train_reaches_the_cluster(build, folder, overrides: list[str]) -> None:
    mistral = folder("mistral", "MistralConfig", sliding_window=8)
    with pytest.raises(_ClusterStarted):
        build(*(o.format(mistral=mistral) for o in overrides))


def test_a_teacher_megatron_cannot_convert_names_its_distill_key(build, folder) -> None:
    """Routed teachers of on-policy distillation, one of them a model the engine maps and one it does not: the
    refusal names the distill key that gave it (it said "teacher domain_code's model", no key to set)."""
    gemma = folder("gemma", "GemmaConfig")
    routed = f"+distill.teachers={{math: 'builtin:tiny', code: '{gemma}'}}"
    with pytest.raises(ConfigError, match=rf"^distill\.teachers\.code={gemma}: .* model_type='gemma'"):
        build("train_engine=megatron", "model=tiny", "pipeline=distill", "distill.teacher=builtin:tiny", routed)
    with pytest.raises(ConfigError, match=rf"^distill\.teacher={gemma}: .* model_type='gemma'"):
        build("train_engine=megatron", "model=tiny", "pipeline=distill_offline", f"distill.teacher={gemma}")


def test_a_config_without_model_type_is_not_sent_to_another_engine(build, folder) -> None:
    """config.json without model_type: no transformers AutoConfig reads it (short of remote code), so "train it with
    train_engine=hf or fsdp2" (as for a type Megatron does not map) was wrong advice: it says what is missing."""
    import json

    import transformers

    llama = folder("llama", "LlamaConfig")
    config = json.loads((llama / "config.json").read_text())
    del config["model_type"]
    (llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type"):  # (what every engine's AutoConfig says of it)
        transformers.AutoConfig.from_pretrained(llama)
    with pytest.raises(ConfigError, match=rf"model\.path={llama}: {llama / 'config.json'} sets no model_type") as e:
        build("train_engine=megatron", f"model.path={llama}")
    assert "add the model's model_type" in str(e.value)
