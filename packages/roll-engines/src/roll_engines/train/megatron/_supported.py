"""What roll's HF <-> Megatron mapping (_convert) can express, checked before anything is built.

Contract: `check_supported(hf_config, tp, pp, ep, sequence_parallel)` returns for a model and layout the mapping
converts exactly (forward equal to transformers', export equal to the checkpoint), and otherwise raises
roll_core.errors.ConfigError naming the model type, the config feature (biases other than q/k/v, an activation
other than SiLU, sliding-window attention, partly sparse MoE stacks, rotary embeddings _rope cannot compute) or the
layout setting to change: never a model that runs and computes something else than transformers' does. (An
engine's set-up error keeps its type on the driver, roll_core.cluster._group_start, and `roll-train` reports a
ConfigError as an invalid config, not as a traceback.)
"""

from __future__ import annotations

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
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError(
            f"this {kind} model uses sliding-window attention (use_sliding_window=true), which the Megatron local "
            "layer spec does not build: train it with train_engine=hf or fsdp2"
        )
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
