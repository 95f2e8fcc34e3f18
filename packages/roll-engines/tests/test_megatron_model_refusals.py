"""Models and config features roll's HF -> Megatron mapping cannot convert exactly are refused before anything is
built, with a ConfigError naming the model type or the feature (roll_engines.train.megatron._supported): a
set-up's ConfigError reaches `roll-train` as an invalid config. Such refusals were bare ValueErrors, reported as a
traceback; only the vision-language refusal was a ConfigError. (The families and features that map are checked
against transformers' forward and export in test_megatron.py, test_megatron_moe.py, test_megatron_rope.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")

from roll_core.errors import ConfigError

REFUSED = {
    "mistral": (("MistralConfig", {"sliding_window": 8}), "model_type='mistral'"),
    "gemma": (("GemmaConfig", {}), "model_type='gemma'"),
    "phi3": (("Phi3Config", {"pad_token_id": 0}), "model_type='phi3'"),
    "llama-mlp-bias": (("LlamaConfig", {"mlp_bias": True}), "mlp_bias=true"),
    "llama-attention-bias": (("LlamaConfig", {"attention_bias": True}), "attention_bias=true"),
    "qwen3-attention-bias": (("Qwen3Config", {"attention_bias": True}), "attention_bias=true"),
    "llama-gelu": (("LlamaConfig", {"hidden_act": "gelu_pytorch_tanh"}), "hidden_act='gelu_pytorch_tanh'"),
    "qwen2-sliding-window": (("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 0}), "sliding-window"),
    "llama-partial-rotary": (
        ("LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
        "partial_rotary_factor=0.5",
    ),
    "llama-dynamic-rope": (
        ("LlamaConfig", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}),
        "rope_type='dynamic'",
    ),
    "qwen3moe-dense-layers": (("Qwen3MoeConfig", {"num_experts": 4, "mlp_only_layers": [1]}), "mlp_only_layers"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_mapping_cannot_convert_is_a_config_error_naming_it(case: str, tiny_hf_config: Any) -> None:
    from roll_engines.train.megatron._convert import check_supported

    (cls, change), feature = REFUSED[case]
    with pytest.raises(ConfigError, match=feature):
        check_supported(tiny_hf_config(cls, **change), tp=1, pp=1)


@pytest.mark.parametrize(
    "cls", ["LlamaConfig", "Qwen2Config", "Qwen3Config", "Qwen3MoeConfig", "Qwen2MoeConfig"], ids=lambda c: c[:-6]
)
def test_the_families_the_mapping_converts_pass(cls: str, tiny_hf_config: Any) -> None:
    from roll_engines.train.megatron._convert import check_supported

    check_supported(tiny_hf_config(cls), tp=2, pp=1, sequence_parallel=True)


def test_the_engine_refuses_an_unmapped_model_before_building_anything(tmp_path: Path, tiny_hf_config: Any) -> None:
    """A Mistral folder (config alone: nothing else is read) fails the engine's construction with the ConfigError,
    before any process group or model exists."""
    from roll_engines.train.megatron import MegatronTrainEngine

    tiny_hf_config("MistralConfig", sliding_window=8).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model_type='mistral': train it with train_engine=hf or fsdp2"):
        MegatronTrainEngine(str(tmp_path), dist_backend="gloo", use_distributed_optimizer=False)
