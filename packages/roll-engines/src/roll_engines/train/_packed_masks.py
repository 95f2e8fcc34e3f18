"""The attention masks of a packed micro-batch per layer type: full attention and sliding-window attention.

Shared-prompt packing (roll_engines.train._packing) places each response after its siblings, away from its prompt,
under a block mask (`PackedBatch.allowed`). A full-attention layer sees keys through that mask alone. A
sliding-window layer of the padded forward (transformers' `create_sliding_window_causal_mask`, sdpa or eager) lets
the query in column q of a padded row see only the keys in columns q-W+1 .. q (`kv_idx > q_idx - sliding_window`),
so in a packed row the window cannot be measured in packed places (a sibling in between would use it up). Each
packed token keeps the column it has in its padded row (`PackedBatch.columns`; a shared prompt sits at the same
columns in every row of its segment), and a windowed layer gets the block mask AND `col(q) - col(k) < W`: exactly
the keys it sees in the padded row.

Why roll builds these masks instead of handing transformers position ids that restart per sequence with
`attention_mask=None` (`masking_utils.find_packed_sequence_indices`): transformers takes each run of consecutive
positions as one independent sequence, so a response (its positions continue its prompt's, after its siblings)
would not see its prompt at all. That fits only unshared packing, which computes each prompt once per response.

Contract:
- `mask_plan(text_config, backbone)`: how a model takes packed masks (a `MaskPlan`), or why it cannot (a str):
  layers other than full and sliding-window attention (chunked, local, convolution, recurrent), chunked attention,
  bidirectional attention, or a window the modeling code (`backbone`'s forward) is not seen to apply through
  `create_sliding_window_causal_mask` / a mask per layer type are refused.
- `packed_masks(packed, plan, attn_implementation)`: the `attention_mask` argument of the packed forward: one 4D
  mask (every layer full, or every layer windowed: Mistral), or {layer type: 4D mask} for models that index their
  masks by `config.layer_types` (Gemma2/3, Qwen2 with `use_sliding_window`, GPT-OSS, ...).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from roll_engines.train._packing import PackedBatch

#: Per-layer attention kinds (config `layer_types`, GPT-Neo's `attention_layers`) that attend by the mask alone.
FULL_ATTENTION_LAYERS = ("full_attention", "global")
#: The layer kind whose keys are the last `config.sliding_window` columns of the padded row.
SLIDING_ATTENTION = "sliding_attention"
# What the modeling code of the models whose masks roll can build says (transformers 5): a model that takes a
# ready {layer type: mask} mapping, and one (Mistral, Mixtral, Phi3, ...) that windows every layer with
# `create_sliding_window_causal_mask` when its config has a window (a 4D mask passes through it as given).
_MAPPING_SOURCE = "isinstance(causal_mask_mapping := attention_mask, dict)"
_SLIDING_SOURCE = "create_sliding_window_causal_mask"


@dataclass(frozen=True)
class MaskPlan:
    """How a model takes the masks of a packed micro-batch.

    Attributes:
        window: the sliding window W in tokens, or None (no layer is windowed).
        layer_types: the model's layer kinds when it takes a mask per layer type ({kind: mask}); () for one mask
            that every layer gets (windowed when `window` is set).
    """

    window: int | None = None
    layer_types: tuple[str, ...] = ()


@functools.cache
def _source(fn: Any) -> str:
    """The source of a function ("" when it has none to read, e.g. compiled or built at run time)."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def mask_plan(text_config: Any, backbone: torch.nn.Module, vision_language: bool = False) -> MaskPlan | str:
    """How `backbone` (the decoder model, whose forward builds the masks) takes packed masks, or why it cannot.

    Args:
        text_config: the decoder's config (a vision-language model's text config).
        backbone: the transformers decoder model (e.g. Gemma3TextModel, MistralModel).
        vision_language: the decoder belongs to a vision-language model (its outer forward builds the masks of
            picture tokens: refused with a window).
    """
    kinds = {str(k) for attr in ("layer_types", "attention_layers") for k in getattr(text_config, attr, None) or []}
    # A layer that is neither full nor sliding-window attention sees tokens by their place in the packed row (a
    # chunk, GPT-Neo's "local" window over the row, a convolution, a recurrence), which no mask given here confines.
    odd = kinds - set(FULL_ATTENTION_LAYERS) - {SLIDING_ATTENTION}
    if odd:
        return (
            f"the model has {', '.join(sorted(odd))} layers (chunked, local, convolution or recurrent layers see "
            "tokens by their place in the row, which the packed masks do not confine)"
        )
    if getattr(text_config, "attention_chunk_size", None):
        return "the model uses chunked attention (chunks start at row places that packing moves)"
    if not getattr(text_config, "is_causal", True) or getattr(text_config, "use_bidirectional_attention", False):
        return "the model uses bidirectional attention (packing needs causal attention)"
    window = getattr(text_config, "sliding_window", None) if getattr(text_config, "use_sliding_window", True) else None
    source = _source(type(backbone).forward)
    name = type(backbone).__name__
    if SLIDING_ATTENTION in kinds:
        if _MAPPING_SOURCE not in source:
            return f"{name} has sliding_attention layers but takes no mask per layer type"
        if not isinstance(window, int) or window < 1:
            return f"{name} has sliding_attention layers but sliding_window={window!r}"
        plan = MaskPlan(window, tuple(sorted(kinds)))
    elif window and _MAPPING_SOURCE not in source:  # (a model with masks per layer type windows none of them)
        if _SLIDING_SOURCE not in source or not isinstance(window, int) or window < 1:
            return f"{name} has sliding_window={window!r}, applied by modeling code roll cannot mask for"
        plan = MaskPlan(window)
    else:
        return MaskPlan()
    if vision_language:
        return "sliding-window layers in a vision-language model (its forward builds the picture tokens' masks)"
    return plan


def _as_attention_mask(allowed: Tensor, attn_implementation: str) -> Tensor:
    """A bool mask (True attends) in the form the attention implementation applies: bool for sdpa, additive
    float for eager (0 attends, the fp32 minimum blocks; eager adds it to the scores)."""
    if attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min
        )
    return allowed


def packed_masks(packed: PackedBatch, plan: MaskPlan, attn_implementation: str) -> Tensor | dict[str, Tensor]:
    """The `attention_mask` argument of the packed forward under `plan` (see the module docstring)."""
    full = packed.allowed
    if plan.window is None:
        return _as_attention_mask(full, attn_implementation)
    cols = packed.columns()  # (N, T): each token's column in its padded row
    # Within a segment every allowed pair has col(q) >= col(k) (causal in the padded row): keep the last W columns.
    windowed = full & ((cols[:, :, None] - cols[:, None, :]) < plan.window)[:, None]
    if not plan.layer_types:
        return _as_attention_mask(windowed, attn_implementation)
    masks = {False: _as_attention_mask(full, attn_implementation)}
    masks[True] = _as_attention_mask(windowed, attn_implementation)
    return {kind: masks[kind == SLIDING_ATTENTION] for kind in plan.layer_types}
