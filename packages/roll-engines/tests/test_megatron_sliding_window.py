"""Sliding-window attention as transformers runs it, judged by train_engine=megatron's mapping
(roll_engines.train.megatron._supported.sliding_layers): a model is refused only where some layer slides.

A Qwen2/Qwen3 config with use_sliding_window=true slides the layers at or past max_window_layers, so none when
max_window_layers >= num_hidden_layers (Qwen2.5's own configs set it to their depth): transformers' forward is then
full attention, which Megatron computes exactly; such models were refused for the flag alone. Qwen2-MoE slides
every other layer *below* max_window_layers and Qwen3-MoE every layer: refused. A config whose layer_types mark a
layer sliding_attention without a window (use_sliding_window=false) is one transformers cannot run: refused as such."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")

from roll_core.errors import ConfigError

WINDOW = {"sliding_window": 4}  # on every config here (tiny_hf_config's shape): what a sliding layer sees
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


SLIDING_NOWHERE = {
    "qwen2-window-past-the-last-layer": ("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 2}),
    "qwen3-window-past-the-last-layer": ("Qwen3Config", {"use_sliding_window": True, "max_window_layers": 5}),
    "qwen2-full-layer-types": (
        "Qwen2Config",
        {"use_sliding_window": True, "max_window_layers": 0, "layer_types": ["full_attention"] * 2},
    ),
    "qwen2moe-window-below-no-layer": ("Qwen2MoeConfig", {"use_sliding_window": True, "max_window_layers": 0, **MOE}),
    "llama-layer-types-unread": ("LlamaConfig", {"layer_types": ["sliding_attention", "full_attention"]}),
}
SLIDING = {
    "qwen2-last-layer": (("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 1}), r"layers \[1\]"),
    "qwen2moe-first-layer": (
        ("Qwen2MoeConfig", {"use_sliding_window": True, "max_window_layers": 2, **MOE}),
        r"layers \[0\]",
    ),
    "qwen3moe-every-layer": (("Qwen3MoeConfig", {"use_sliding_window": True, **MOE}), r"layers \[0, 1\]"),
}
NO_WINDOW = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen2moe": ("Qwen2MoeConfig", MOE),
}


@pytest.mark.parametrize("case", list(SLIDING_NOWHERE))
def test_a_window_no_layer_uses_is_accepted(case: str, tiny_hf_config: Any) -> None:
    from roll_engines.train.megatron._supported import check_supported

    cls, change = SLIDING_NOWHERE[case]
    check_supported(tiny_hf_config(cls, **WINDOW, **change), tp=1, pp=1)


@pytest.mark.parametrize("case", list(SLIDING))
def test_a_layer_that_slides_is_refused_naming_it(case: str, tiny_hf_config: Any) -> None:
    from roll_engines.train.megatron._supported import check_supported

    (cls, change), layers = SLIDING[case]
    with pytest.raises(ConfigError, match=rf"sliding window of 4 tokens in {layers} .*sliding-window attention"):
        check_supported(tiny_hf_config(cls, **WINDOW, **change), tp=1, pp=1)


@pytest.mark.parametrize("case", list(NO_WINDOW))
def test_sliding_layer_types_without_a_window_are_refused_as_transformers_cannot_run_them(
    case: str, tiny_hf_config: Any
) -> None:
    """transformers' own forward of such a config fails (qwen2/qwen3: a TypeError building the sliding mask; qwen2_moe,
    whose missing window is 0: a shape error), so there is nothing to match: a ConfigError says what to fix."""
    import transformers

    from roll_engines.train.megatron._supported import check_supported

    cls, extra = NO_WINDOW[case]
    cfg = tiny_hf_config(
        cls, **WINDOW, use_sliding_window=False, layer_types=["sliding_attention", "full_attention"], **extra
    )
    with pytest.raises((TypeError, RuntimeError, ValueError)):
        transformers.AutoModelForCausalLM.from_config(cfg).eval()(torch.arange(9)[None])
    with pytest.raises(ConfigError, match=r"layers \[0\] sliding_attention, yet it sets no window .* cannot run it"):
        check_supported(cfg, tp=1, pp=1)


@pytest.mark.usefixtures("megatron_process_group")
def test_qwen2_with_a_window_past_its_last_layer_trains_as_transformers_runs_it(tmp_path: Path) -> None:
    """A tiny Qwen2 whose config.json sets use_sliding_window=true, a 4-token window and max_window_layers=2 (its
    depth; no layer_types, as Qwen2.5's own configs): the engine's log-probs are transformers' (1e-5) and its export
    the checkpoint. The window is short enough to matter: sliding the last layer moves transformers' logits."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from roll_core.testing.batches import toy_batch
    from roll_core.testing.models import assert_matches_transformers, tiny_model
    from roll_engines.train.megatron import MegatronTrainEngine

    path = tiny_model("qwen2", tmp_path / "qwen2")
    config = json.loads((Path(path) / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(use_sliding_window=True, sliding_window=4, max_window_layers=2)
    (Path(path) / "config.json").write_text(json.dumps(config))

    hf_config = AutoConfig.from_pretrained(path)
    assert hf_config.layer_types == ["full_attention"] * 2  # (transformers' own reading of the flags)
    ids = toy_batch(path)["input_ids"][:1, :13]  # the first row, unpadded: 13 tokens
    with torch.no_grad():
        full = AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits
        hf_config.layer_types = ["full_attention", "sliding_attention"]  # as max_window_layers=1 would derive
        slid = AutoModelForCausalLM.from_pretrained(path, config=hf_config).eval()(ids).logits
    assert (full - slid).abs().max() > 1e-2  # one sliding layer would change the logits

    eng = MegatronTrainEngine(path, dist_backend="gloo", use_distributed_optimizer=False, micro_batch_size=4)
    assert_matches_transformers(eng, path, load_file(str(Path(path) / "model.safetensors")))
