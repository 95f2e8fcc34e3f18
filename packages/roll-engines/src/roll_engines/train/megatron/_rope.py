"""Scaled rotary embeddings (an HF config's `rope_type`) in roll's Megatron mapping: Megatron rotates q and k by
exactly the frequencies, and scales cos/sin by exactly the attention factor, that transformers' model does.

| rope_type | transformers (modeling_rope_utils) | Megatron-Core here |
|---|---|---|
| default | base^(-2i/d) | RotaryEmbedding(rotary_base=rope_theta) |
| linear, llama3 | static, rescaled inv_freq; attention factor 1 | RotaryEmbedding with transformers' inv_freq |
| yarn | ramped inv_freq; cos/sin times an attention factor | YarnRotaryEmbedding, the model's constants |

llama3: Megatron's own scaling (GPTModel(rope_scaling=True, rope_scaling_factor=f)) is transformers' formula with
low_freq_factor=1, high_freq_factor=4 and original_max_position_embeddings=8192 hard-coded, so it is exact only
for Meta's own Llama 3.x constants; the model's `inv_freq`, computed by transformers, is exact for every model.
yarn: Megatron's YarnRotaryEmbedding is transformers' formula, configured by `yarn_*` attributes of the
TransformerConfig that GPTModel reads (and its attention, for the attention factor); no TransformerConfig field of
megatron-core 0.16 declares them, so `configure` sets them: factor, original_max_position_embeddings, beta_fast,
beta_slow, truncate (Megatron's correction_range_round_to_int), mscale and mscale_all_dim. An explicit
`attention_factor` other than the one those give cannot be expressed and is refused.

Parallelism: every tensor-parallel rank builds its own rotary module (the same frequencies, its own heads); under
context parallelism the engine rotates each rank's slice at its own positions (_packed.rope_at), not by Megatron's
zig-zag split. YarnRotaryEmbedding still splits its cached table of the original context into 2 x CP chunks when
built, so yarn needs original_max_position_embeddings to be a multiple of 2 x CP (refused otherwise, by `configure`).

Refused with a ConfigError naming the setting (never a silent approximation): rope types whose frequencies depend on
the sequence length (dynamic, longrope) or that Megatron has no form of, and a partial rotary factor. `verify`
compares the built module's frequencies and attention factor with transformers' and refuses any difference (a
RuntimeError: a mapping defect, not a setting to change).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from roll_core.errors import ConfigError

#: rope types whose static frequencies roll hands Megatron's RotaryEmbedding (attention factor 1)
_OWN_FREQUENCIES = ("linear", "llama3")
SUPPORTED = ("default", *_OWN_FREQUENCIES, "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters (transformers 5's `rope_parameters`, or the older `rope_scaling`)."""
    return dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})


def rope_type(hf_config: Any) -> str:
    """The config's rope type ("default" when it scales nothing)."""
    params = rope_parameters(hf_config)
    return params.get("rope_type", params.get("type")) or "default"


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(hf_config: Any) -> dict[str, Any]:
    """The model's YaRN constants with transformers' defaults (_compute_yarn_parameters), as Megatron's `yarn_*`
    config attributes."""
    p = rope_parameters(hf_config)
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or hf_config.max_position_embeddings / original
    # transformers takes the mscale ratio only when both are set and non-zero, else log(factor) alone: Megatron
    # takes the ratio unless one is None.
    both = bool(p.get("mscale")) and bool(p.get("mscale_all_dim"))
    return {
        "yarn_rotary_scaling_factor": float(factor),
        "yarn_original_max_position_embeddings": int(original),
        "yarn_beta_fast": float(p.get("beta_fast") or 32),
        "yarn_beta_slow": float(p.get("beta_slow") or 1),
        "yarn_mscale": float(p["mscale"]) if both else None,
        "yarn_mscale_all_dim": float(p["mscale_all_dim"]) if both else None,
        "yarn_correction_range_round_to_int": bool(p.get("truncate", True)),
    }


def check_rope(hf_config: Any) -> None:
    """ConfigError for rotary embeddings roll's Megatron mapping cannot compute exactly as transformers does."""
    kind, params, rtype = hf_config.model_type, rope_parameters(hf_config), rope_type(hf_config)
    hint = "train it with train_engine=hf or fsdp2"
    if rtype not in SUPPORTED:
        # dynamic/longrope rescale with the sequence length; others have no Megatron form here
        raise ConfigError(
            f"this {kind} model scales its rotary embeddings with rope_type={rtype!r}, which roll's Megatron mapping "
            f"does not compute (it maps {', '.join(SUPPORTED)}): {hint}"
        )
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(
            f"this {kind} model rotates part of each head (partial_rotary_factor={partial}); roll's Megatron "
            f"mapping rotates whole heads: {hint}"
        )
    if rtype == "yarn":
        if "original_max_position_embeddings" not in params:
            raise ConfigError(f"this {kind} model's yarn rope_parameters lack original_max_position_embeddings")
        y = _yarn(hf_config)
        s, m, m_all = y["yarn_rotary_scaling_factor"], y["yarn_mscale"], y["yarn_mscale_all_dim"]
        derived = _yarn_mscale(s, m) / _yarn_mscale(s, m_all) if m is not None else _yarn_mscale(s)
        given = params.get("attention_factor")
        if given is not None and not math.isclose(float(given), derived, rel_tol=1e-9):
            raise ConfigError(
                f"this {kind} model's yarn rope_parameters set attention_factor={given}, not the {derived:.6g} its "
                "factor, mscale and mscale_all_dim give: Megatron-Core's YarnRotaryEmbedding derives the attention "
                f"factor from those and takes no other: {hint}"
            )


def model_kwargs(hf_config: Any) -> dict[str, Any]:
    """GPTModel's position-embedding arguments (GPTModel reads `rotary_base` from the argument, not the config)."""
    params = rope_parameters(hf_config)
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    return {"position_embedding_type": "yarn" if rope_type(hf_config) == "yarn" else "rope", "rotary_base": theta}


def configure(config: Any, hf_config: Any) -> Any:
    """`config` (a TransformerConfig) with the `yarn_*` attributes GPTModel's YarnRotaryEmbedding and its attention's
    attention factor read, for a yarn model; unchanged otherwise (the attention tests `hasattr`, so a model without
    YaRN must not have them). ConfigError for a yarn original context that `config`'s CP size cannot split."""
    if rope_type(hf_config) == "yarn":
        yarn = _yarn(hf_config)
        cp, original = config.context_parallel_size, yarn["yarn_original_max_position_embeddings"]
        if cp > 1 and original % (2 * cp):
            # YarnRotaryEmbedding caches its table of the original context when built and, under CP, views it as
            # 2 x CP chunks (Megatron's zig-zag split): another length fails inside Megatron with a bare shape error.
            # (roll rotates by its own positions, not that cache; the check only keeps the build from crashing.)
            raise ConfigError(
                f"this {hf_config.model_type} model's yarn original_max_position_embeddings={original} is not a "
                f"multiple of 2 x context_parallel_size={2 * cp}, which Megatron-Core's YarnRotaryEmbedding needs "
                "to build: use a context_parallel_size whose double divides it, or train_engine=hf or fsdp2"
            )
        for name, value in yarn.items():
            setattr(config, name, value)
    return config


def _transformers(hf_config: Any) -> tuple[torch.Tensor, float]:
    """transformers' own (inv_freq, attention factor) of a scaled rope type: what its model rotates by."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type(hf_config)](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(attention_factor)


def install(model: Any, hf_config: Any) -> Any:
    """`model` (a GPTModel of `model_kwargs` and a `configure`d config) rotating by `hf_config`'s scaled frequencies:
    transformers' inv_freq for linear and llama3; checked against transformers' by `verify` for every scaled type."""
    rtype, rope = rope_type(hf_config), model.rotary_pos_emb
    if rtype in _OWN_FREQUENCIES:
        # Megatron moves inv_freq to the model's device on its first forward
        rope.inv_freq = _transformers(hf_config)[0].to(rope.inv_freq.device)
    if rtype != "default":
        verify(model, hf_config)
    return model


def verify(model: Any, hf_config: Any) -> None:
    """RuntimeError unless the model's rotary frequencies and attention factor are transformers' (rtol 1e-6)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    inv_freq, attention_factor = _transformers(hf_config)
    emb = model.rotary_pos_emb.get_emb(2)  # (2, 1, 1, D): position 1's angles are the frequencies, twice
    emb = emb[0] if isinstance(emb, tuple) else emb  # YarnRotaryEmbedding: (angles, its factor)
    got = emb[1, 0, 0, : emb.shape[-1] // 2].float().cpu()
    factor = _yarn_get_concentration_factor_from_config(model.config)
    if (
        got.shape != inv_freq.shape
        or not torch.allclose(got, inv_freq, rtol=1e-6, atol=0)
        or not math.isclose(factor, attention_factor, rel_tol=1e-6)
    ):
        raise RuntimeError(
            f"Megatron-Core's rotary embedding differs from transformers' for rope_type={rope_type(hf_config)!r} "
            f"(frequencies {got.tolist()} vs {inv_freq.tolist()}, attention factor {factor} vs {attention_factor}): "
            "train this model with train_engine=hf or fsdp2"
        )
