"""What roll's HF <-> Megatron mapping (_convert) can express, checked before anything is built.

Contract: `check_supported(hf_config, tp, pp, ep, sequence_parallel)` returns for a model and layout the mapping
converts exactly (forward equal to transformers', export equal to the checkpoint), and otherwise raises
roll_core.errors.ConfigError naming the model type, the config feature (biases other than q/k/v, an activation
other than SiLU, a layer transformers runs through a sliding window: `sliding_layers`, partly sparse MoE stacks,
rotary embeddings _rope cannot compute) or the layout setting to change: never a model that runs and computes
something else than transformers' does. `check_model_folder` checks the same from a model folder's config.json
alone, which the engine config does before any worker starts (roll_core.pipelines.wiring.check_train_models). (An
engine's set-up error keeps its type on the driver, roll_core.cluster._group_start, and `roll-train` reports a
ConfigError as an invalid config, not as a traceback.)
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from roll_core.errors import ConfigError
from roll_engines.train.megatron import _rope as R

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
MOE = ("qwen3_moe", "qwen2_moe")


def is_moe(hf_config: Any) -> bool:
    return hf_config.model_type in MOE


def check_supported(hf_config: Any, tp: int, pp: int, ep: int = 1, sequence_parallel: bool = False) -> None:
    """ConfigError naming the setting for what roll's mapping (_convert) cannot express: the model type, a feature
    of its config, or the layout (tp, pp, ep, sequence_parallel) against the model's shape."""
    kind = hf_config.model_type
    from roll_core.multimodal import FAMILIES

    if kind in FAMILIES:
        raise ConfigError(
            f"train_engine=megatron cannot train the vision-language model {kind!r}: roll maps no vision tower (nor "
            "its picture positions) to Megatron layers; train it with train_engine=hf or train_engine=fsdp2"
        )
    if kind not in SUPPORTED:
        raise ConfigError(
            f"train_engine=megatron maps {', '.join(SUPPORTED)} models, not model_type={kind!r}: train it with "
            "train_engine=hf or fsdp2"
        )
    if is_moe(hf_config):
        if hf_config.decoder_sparse_step != 1 or list(hf_config.mlp_only_layers or []):
            raise ConfigError(
                f"train_engine=megatron maps {kind} models whose every layer is sparse (decoder_sparse_step=1, no "
                f"mlp_only_layers), not decoder_sparse_step={hf_config.decoder_sparse_step}, "
                f"mlp_only_layers={list(hf_config.mlp_only_layers or [])}"
            )
        if tp > 1 and not sequence_parallel:
            raise ConfigError(
                "tensor_parallel_size > 1 with a MoE model: Megatron-Core trains MoE layers under tensor parallelism "
                "only with sequence parallelism: set train_engine.sequence_parallel=true (or shard the experts with "
                "expert_model_parallel_size and the depth with pipeline_parallel_size instead)"
            )
        if hf_config.num_experts % ep:
            raise ConfigError(
                f"expert_model_parallel_size={ep} must divide the model's {hf_config.num_experts} experts"
            )
    elif ep != 1:
        raise ConfigError(
            f"train_engine.expert_model_parallel_size={ep}: this {kind} model is dense (no experts to shard); use 1"
        )
    R.check_rope(hf_config)  # scaled RoPE: only where Megatron rotates exactly as transformers (_rope)
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        # transformer_config builds SwiGLU (silu): any other activation would give wrong log-probs, silently
        raise ConfigError(
            f"this {kind} model's MLP activation is hidden_act={act!r}; roll's Megatron mapping builds SiLU (SwiGLU) "
            "only: train it with train_engine=hf or fsdp2"
        )
    for flag, what in (("attention_bias", "o_proj"), ("mlp_bias", "MLP")):
        if getattr(hf_config, flag, False):
            # only q/k/v biases are mapped: the others were dropped on load, untrained and missing from exports
            raise ConfigError(
                f"this {kind} model has {flag}=true ({what} biases), which roll's Megatron mapping does not carry: "
                "train it with train_engine=hf or fsdp2"
            )
    _check_sliding_window(hf_config)
    if hf_config.num_key_value_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} must divide the model's {hf_config.num_key_value_heads} key/value heads"
        )
    # Megatron splits each MLP's width over the tensor-parallel ranks (column-parallel): a width TP does not
    # divide failed deep inside Megatron's layer build with a bare assertion.
    widths = {"intermediate_size": getattr(hf_config, "intermediate_size", None)}
    if is_moe(hf_config):
        widths["moe_intermediate_size"] = getattr(hf_config, "moe_intermediate_size", None)
        widths["shared_expert_intermediate_size"] = getattr(hf_config, "shared_expert_intermediate_size", None)
    for name, width in widths.items():
        if width and width % tp:
            raise ConfigError(f"tensor_parallel_size={tp} must divide the model's {name}={width}")
    if hf_config.num_hidden_layers % pp:
        raise ConfigError(f"pipeline_parallel_size={pp} must divide the model's {hf_config.num_hidden_layers} layers")
    if pp > 1 and hf_config.tie_word_embeddings:
        raise ConfigError("tied embeddings with pipeline parallelism are not supported: set pipeline_parallel_size=1")


def sliding_layers(hf_config: Any) -> list[int]:
    """The layers transformers' model of `hf_config` runs with a sliding window, as its modeling code (5.x) decides.
    qwen2, qwen3 and qwen2_moe slide the layers `layer_types` marks "sliding_attention" (listed in config.json, or
    derived by the config class: qwen2 and qwen3 slide layers at or past max_window_layers once use_sliding_window
    is set, so none when max_window_layers >= num_hidden_layers; qwen2_moe every other layer below it);
    qwen3_moe slides every layer once use_sliding_window sets a window; llama's modeling reads neither key."""
    kind, layers = hf_config.model_type, range(hf_config.num_hidden_layers)
    if kind == "llama":
        return []
    if kind == "qwen3_moe":
        return list(layers) if getattr(hf_config, "sliding_window", None) is not None else []
    types = getattr(hf_config, "layer_types", None)
    if types is None:  # a config class without layer_types: the flag alone, as every layer (refused, never missed)
        return list(layers) if getattr(hf_config, "use_sliding_window", False) else []
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _check_sliding_window(hf_config: Any) -> None:
    """ConfigError for a model with a layer transformers runs through a sliding window (Megatron's local layer spec
    builds full causal attention only), or one whose layer_types mark sliding layers without a window, which
    transformers' own model cannot run (its mask build fails: qwen2 and qwen3 with a TypeError, qwen2_moe's window 0
    with a shape error). A Qwen2 config with use_sliding_window=true and max_window_layers >= num_hidden_layers
    slides no layer and is accepted: its forward is exactly full attention."""
    kind, sliding = hf_config.model_type, sliding_layers(hf_config)
    if not sliding:
        return
    flag, window = getattr(hf_config, "use_sliding_window", None), getattr(hf_config, "sliding_window", None)
    if not window:
        raise ConfigError(
            f"this {kind} model's layer_types mark layers {sliding} sliding_attention, yet it sets no window "
            f"(use_sliding_window={flag}, so sliding_window={window}): transformers' own model cannot run it (its "
            "sliding mask needs a window). Fix the model's config.json: layer_types of full_attention only, or "
            "use_sliding_window=true with its sliding_window"
        )
    raise ConfigError(
        f"this {kind} model attends through a sliding window of {window} tokens in layers {sliding} "
        f"(use_sliding_window={flag}, max_window_layers={getattr(hf_config, 'max_window_layers', None)}, "
        "layer_types): sliding-window attention, which the Megatron local layer spec does not build: train it with "
        "train_engine=hf or fsdp2"
    )


def check_model_folder(
    folder: str | Path, tp: int, pp: int, ep: int = 1, sequence_parallel: bool = False, cp: int = 1
) -> None:
    """`check_supported` and the yarn context-parallel split (_rope.configure) for the HF model folder `folder`, from
    its config.json alone (no weights): the config's check before any worker starts
    (roll_engines.config.MegatronTrainEngineConfig.check_model). A folder without config.json is left to the
    engine's load."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return
    try:
        kind = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{path} is no readable model config (JSON object): {exc}") from exc
    if not isinstance(kind, str):  # "not model_type=None: train it with hf" sent a config no engine reads to hf
        raise ConfigError(
            f"{path} sets no model_type: train_engine=megatron maps {', '.join(SUPPORTED)} models by it, and "
            "transformers' AutoConfig reads a config.json without one only through its auto_map's remote code "
            "(model.trust_remote_code, train_engine=hf or fsdp2): add the model's model_type to its config.json"
        )
    if kind not in SUPPORTED:  # refused by its type alone: transformers may not even know it
        check_supported(SimpleNamespace(model_type=kind), tp, pp, ep, sequence_parallel)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder)
    check_supported(hf_config, tp, pp, ep, sequence_parallel)
    R.configure(SimpleNamespace(context_parallel_size=cp), hf_config)  # only its refusal: the namespace is dropped
