"""Inference-engine defaults that depend on the run: sleep_level and SGLang's mem_fraction_static.

A colocated engine on an accelerator must release its device memory while the trainer runs (sleep_level 1), and
SGLang must not claim 80% of a GPU it shares with the trainer, reference and critic. Explicit values always win.
"""

from __future__ import annotations

import pytest

from roll_core.config import compose, to_object
from roll_core.config.schema import resolve_sleep_level
from roll_engines.config import SGLangInferEngineConfig, VLLMInferEngineConfig, resolve_mem_fraction_static


def _never_asked() -> bool:
    raise AssertionError("the device only matters for a colocated synchronous run with sleep_level null")


@pytest.mark.parametrize(
    ("colocated", "accelerator", "async_rollout", "expected"),
    [
        (True, True, False, 1),  # shares a GPU with the trainer: free the KV cache and offload weights
        (True, False, False, 0),  # CPU: nothing to free (vLLM has no sleep mode there)
        (False, True, False, 0),  # disaggregated: the engine owns its devices
        (True, True, True, 0),  # asynchronous: engines generate while the trainer trains
    ],
)
def test_null_sleep_level_resolves_from_placement_device_and_async(
    colocated: bool, accelerator: bool, async_rollout: bool, expected: int
) -> None:
    assert (
        resolve_sleep_level(None, colocated=colocated, accelerator=lambda: accelerator, async_rollout=async_rollout)
        == expected
    )


@pytest.mark.parametrize("explicit", [0, 1, 2])
def test_explicit_sleep_level_is_kept(explicit: int) -> None:
    for colocated, async_rollout in [(True, False), (False, False), (True, True)]:
        assert (
            resolve_sleep_level(explicit, colocated=colocated, accelerator=_never_asked, async_rollout=async_rollout)
            == explicit
        )


def test_device_is_probed_only_when_it_decides() -> None:
    assert resolve_sleep_level(None, colocated=False, accelerator=_never_asked, async_rollout=False) == 0
    assert resolve_sleep_level(None, colocated=True, accelerator=_never_asked, async_rollout=True) == 0


def test_sglang_mem_fraction_default_leaves_room_when_colocated() -> None:
    assert resolve_mem_fraction_static(None, colocated=True) == 0.5
    assert resolve_mem_fraction_static(None, colocated=False) == 0.8
    assert resolve_mem_fraction_static(0.3, colocated=False) == 0.3
    assert resolve_mem_fraction_static(0.9, colocated=True) == 0.9


def test_schema_defaults_are_null_until_the_run_resolves_them() -> None:
    assert VLLMInferEngineConfig().sleep_level is None
    assert SGLangInferEngineConfig().sleep_level is None and SGLangInferEngineConfig().mem_fraction_static is None
    # SGLang cannot release memory without torch_memory_saver: null means 0 then.
    assert SGLangInferEngineConfig(enable_memory_saver=False).sleep_level == 0


@pytest.mark.parametrize(
    ("overrides", "sleep_level"),
    [
        (["hw=cuda"], 1),
        (["hw=cuda", "cluster.placement=disaggregated"], 0),
        (["hw=cuda", "pipeline.async_ratio=1"], 0),
        (["hw=cpu"], 0),
        (["hw=cuda", "infer_engine.sleep_level=2"], 2),
        (["hw=cuda", "infer_engine.sleep_level=0"], 0),
    ],
)
def test_vllm_run_config_resolves_sleep_level(overrides: list[str], sleep_level: int) -> None:
    typed = to_object(compose(["infer_engine=vllm", *overrides]))
    assert typed.infer_engine.sleep_level == sleep_level


@pytest.mark.parametrize(
    ("overrides", "sleep_level", "mem_fraction"),
    [
        ([], 1, 0.5),  # SGLang runs on GPUs only: colocated means sharing one, wherever the driver runs
        (["cluster.placement=disaggregated"], 0, 0.8),
        (["infer_engine.mem_fraction_static=0.7"], 1, 0.7),
        (["infer_engine.enable_memory_saver=false"], 0, 0.5),
    ],
)
def test_sglang_run_config_resolves_memory_defaults(
    overrides: list[str], sleep_level: int, mem_fraction: float
) -> None:
    typed = to_object(compose(["infer_engine=sglang", "hw=cuda", *overrides]))
    assert (typed.infer_engine.sleep_level, typed.infer_engine.mem_fraction_static) == (sleep_level, mem_fraction)


def test_hf_engine_keeps_its_explicit_default() -> None:
    typed = to_object(compose(["hw=cuda"]))
    assert typed.infer_engine.name == "hf" and typed.infer_engine.sleep_level == 0


@pytest.mark.parametrize("pipeline", ["dpo", "distill_offline", "rollout", "sft"])
@pytest.mark.parametrize("setting", ["pipeline.async_ratio=2", "pipeline.partial_rollout=true"])
def test_synchronous_pipelines_refuse_asynchronous_settings(pipeline: str, setting: str) -> None:
    """Pipelines that generate nothing while training refuse async_ratio / partial_rollout before any model loads
    (they were read by nothing, while async_ratio still kept a colocated engine awake)."""
    from roll_core import registry
    from roll_core.config import ConfigError, load_config
    from roll_core.config.build import build

    extra = ["pipeline.async_ratio=1"] if setting.startswith("pipeline.partial") else []
    cfg = load_config([f"pipeline={pipeline}", setting, *extra, "data.path=/tmp/rows.jsonl"])
    with pytest.raises(ConfigError, match="async_ratio"):
        registry.load("roll.collectors", pipeline).check(cfg, None)
    # rlvr runs asynchronously with the same settings: its check says nothing about them
    rlvr = load_config(["pipeline=rlvr", setting, *extra])
    registry.load("roll.collectors", "rlvr").check(rlvr, build(rlvr.env))


@pytest.mark.parametrize(
    "extra, want",
    [
        ([], {"enable_thinking": False}),  # the model's: rows rendered as its prompts are
        (["+data.chat_template_kwargs.enable_thinking=true"], {"enable_thinking": True}),  # data's key wins
    ],
)
def test_post_training_rows_are_rendered_with_the_models_chat_template_kwargs(extra: list[str], want: dict) -> None:
    """model=qwen3_nothink renders prompts without thinking; SFT rows were rendered with data's kwargs only, so the
    model learned to write the empty think block its evaluation prompts already end with."""
    cfg = to_object(compose(["pipeline=sft", "model=qwen3_nothink", "data.path=rows.jsonl", *extra]))
    assert cfg.data.chat_template_kwargs == want and cfg.model.chat_template_kwargs == {"enable_thinking": False}
