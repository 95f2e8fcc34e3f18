"""Decode-step attention for the hf inference engine on CPU: grouped-query heads laid out as rows of their shared
key/value head.

At a decode step (one query token per row) with no attention mask, transformers' `sdpa` implementation passes
`enable_gqa=True` to SDPA with the query as (B, H, 1, D). On CPU in bf16 that kernel takes ~3.4x as long as the
same product with the G query heads that share a key/value head stacked as G query rows of it, (B, H_kv, G, D),
which is what transformers itself does when a mask is present (`pack_gqa`): measured on AVX512-BF16, SmolLM2-135M
shapes (32 rows, 3 KV heads, 3 query heads each, cold cache), 1569 -> 458 us per layer, and the bf16 quickstart
rollout 1.35-1.7x faster in the engine. The outputs differ from the other layout's by bf16 rounding (another
blocking of the same fp32 accumulation). In fp32 the stacked layout was not faster (0.89x in the engine), so fp32
keeps `sdpa`'s own path.

Contract: `DECODE_SDPA` is an attention implementation registered in transformers' AttentionInterface (and its
mask function is `sdpa`'s, so masks are what `sdpa` gets). `decode_sdpa_forward` computes what
`sdpa_attention_forward` computes (on the stacked path up to bf16/fp16 rounding, elsewhere bit for bit: it is the
same call); it takes the stacked layout only for a single query token, grouped heads, no
mask, no position bias, no dropout and a bf16 or fp16 CPU tensor, and hands everything else to
`sdpa_attention_forward`.
`use_decode_attention(model)` switches a loaded model from `sdpa` to it (True) or leaves it (False: another
implementation was asked for, the model cannot take a registered implementation, or its modeling code branches on
the implementation's name, e.g. `if _attn_implementation in ("eager", "sdpa")`, and would take another branch
under a new name). A switched model carries the name in its config: a process that unpickles one must import this
module and call `use_decode_attention` (or `_register`) first.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

import torch
from torch import Tensor

DECODE_SDPA = "roll_decode_sdpa"


def decode_sdpa_forward(
    module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kw: Any
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query (B, H, Q, D), key/value (B, H_kv, L, D) -> output
    (B, Q, H, D), None."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.utils.import_utils import is_torchdynamo_compiling

    b, h, q_len, d = query.shape
    kv_heads = key.shape[1]
    plain = (
        attention_mask is None
        and kw.get("position_bias") is None
        and kw.get("softcap") is None
        and not kw.get("dropout")
        and not kw.get("output_attentions")
    )
    # Grouped heads as transformers lays them out (head h reads key/value head h // groups), shapes that agree.
    grouped = kv_heads < h and h % kv_heads == 0 and value.shape[1] == kv_heads and key.shape[0] == value.shape[0] == b
    reduced = query.dtype in (torch.bfloat16, torch.float16)
    if (
        q_len != 1
        or not grouped
        or not plain
        or not reduced
        or query.device.type != "cpu"
        or is_torchdynamo_compiling()
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    # One query token attends to every cached position: no causal mask.
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, kv_heads, h // kv_heads, d), key, value, scale=kw.get("scaling")
    )
    return out.reshape(b, h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_SDPA, decode_sdpa_forward)
    AttentionMaskInterface.register(DECODE_SDPA, sdpa_mask)


#: Modeling code that compares the implementation's name (a branch `sdpa` takes and another name would not).
_NAME_CHECK = re.compile(r"_attn_implementation\s*(==|!=|not\s+in|in)\s")


def _branches_on_name(model: torch.nn.Module) -> bool:
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    for mod in modules:
        if mod is None or not getattr(mod, "__name__", "").startswith("transformers.models."):
            continue
        try:
            if _NAME_CHECK.search(inspect.getsource(mod)):
                return True
        except (OSError, TypeError):  # no source to read: assume it might
            return True
    return False


def use_decode_attention(model: torch.nn.Module) -> bool:
    """Switch `model` (loaded with attn_implementation="sdpa") to `DECODE_SDPA`; False where it stays as it is."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    if _branches_on_name(model):
        return False
    try:
        _register()  # a transformers without these registries keeps `sdpa`
        model.set_attn_implementation(DECODE_SDPA)
    except (ValueError, ImportError, AttributeError):  # or a model class that takes only its own implementations
        return False
    return model.config._attn_implementation == DECODE_SDPA
