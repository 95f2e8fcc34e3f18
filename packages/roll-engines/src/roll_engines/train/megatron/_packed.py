"""Micro-batch shapes in Megatron: roll's shared-prompt packing (roll_engines.train._packing) padded to one shape
per pipeline schedule, rotary embeddings at each packed token's own position, and unpacked rows left-padded to a
width that sequence and context parallelism can split; the model inputs (ids, positions, mask) of each."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


@contextlib.contextmanager
def rope_at(model: Any, position_ids: Tensor | None) -> Iterator[None]:
    """Rotary embeddings at `position_ids` (B, S) instead of Megatron's 0..S-1 in sequence order (its GPTModel
    uses position ids for learned embeddings only): a packed response that follows its siblings in a row must be
    rotated by its own positions. Rotary frequencies (S, B, 1, D) broadcast over heads like the (S, 1, 1, D) ones."""
    rope = getattr(model, "rotary_pos_emb", None)
    if position_ids is None or rope is None:
        yield
        return
    original = rope.forward

    def at_positions(max_seq_len: int, *args: Any, **kwargs: Any) -> Any:
        # packed_seq: the whole table (under context parallelism Megatron would slice it for its own CP split).
        out = original(int(position_ids.max()) + 1, *args, **{**kwargs, "packed_seq": True})  # (L, 1, 1, D)
        # YarnRotaryEmbedding returns (table, attention factor); GPTModel unpacks it
        emb = out[0] if isinstance(out, tuple) else out
        emb = emb[position_ids.t().to(emb.device)][:, :, 0]  # (S, B, 1, D)
        return (emb, *out[1:]) if isinstance(out, tuple) else emb

    rope.forward = at_positions
    try:
        yield
    finally:
        del rope.forward  # the class's forward again


def pad_packed(packed: Any, n: int, t: int) -> Any:
    """`packed` grown to n rows of t tokens: new positions see only themselves and feed no output (the keep order,
    row-major, is unchanged, so `source` still indexes it)."""
    rows, width = packed.input_ids.shape
    if (rows, width) == (n, t):
        return packed
    ids = packed.input_ids.new_zeros((n, t))
    ids[:rows, :width] = packed.input_ids
    pos = packed.position_ids.new_zeros((n, t))
    pos[:rows, :width] = packed.position_ids
    allowed = torch.eye(t, dtype=torch.bool).expand(n, 1, t, t).clone()
    allowed[:rows, :, :width, :width] = packed.allowed
    keep = torch.zeros((n, t), dtype=torch.bool)
    keep[:rows, :width] = packed.keep
    origin = None  # the new positions come from no batch position (routed-expert replay: UNROUTED)
    if packed.origin is not None:
        origin = torch.full((n, t), -1, dtype=packed.origin.dtype)
        origin[:rows, :width] = packed.origin
    return dataclasses.replace(packed, input_ids=ids, position_ids=pos, allowed=allowed, keep=keep, origin=origin)


def left_pad(micro: dict, k: int) -> dict:
    """`micro` with its prompt-side tensors left-padded to a width that is a multiple of `k` (masked positions:
    attention_mask 0; RoPE is relative, and responses are read from the right, so log-probs do not change)."""
    s = micro["input_ids"].shape[1]
    extra = -s % k
    if not extra:
        return micro
    out = dict(micro)
    for key in ("input_ids", "attention_mask", "position_ids"):
        if key in micro:
            t = micro[key]
            out[key] = torch.cat([t.new_zeros(t.shape[0], extra), t], dim=1)
    return out


def prepare(micros: list[dict], pack_sequences: bool, multiple: int, hidden_size: int, device: Any) -> list[dict]:
    """With `pack_sequences`, each micro-batch gets its packed form under "_packed" (roll_engines.train._packing:
    a group's prompt once, no padding) where it packs; all packed ones are padded to one (rows, width), the shape
    pipeline stages exchange. Megatron's local attention applies the block mask as given. Every width is padded to
    a multiple of `multiple` (CP x TP under sequence parallelism; unpacked rows on the left, as masked positions)."""
    packed = []
    if pack_sequences:
        from roll_engines.train._packing import pack

        packed = [
            pack(m["input_ids"], m["attention_mask"], m["position_ids"], m["responses"], hidden_size) for m in micros
        ]
    if not packed or any(p is None for p in packed):  # one shape for every micro-batch: all packed or none
        return micros if multiple == 1 else [left_pad(m, multiple) for m in micros]
    n = max(p.input_ids.shape[0] for p in packed)
    t = -(-max(p.input_ids.shape[1] for p in packed) // multiple) * multiple
    return [{**m, "_packed": pad_packed(p, n, t).to(device)} for m, p in zip(micros, packed)]


def model_inputs(micro: dict, device: Any) -> tuple[Tensor, Tensor, Tensor]:
    """(input ids (B, S), position ids (B, S), attention mask (B, 1, S, S), True where blocked) of a micro-batch."""
    packed = micro.get("_packed")
    if packed is not None:  # Megatron's mask is True where attention is blocked
        return packed.input_ids, packed.position_ids, ~packed.allowed
    ids = micro["input_ids"].to(device)
    s = ids.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)
    mask = causal[None, None] | (micro["attention_mask"].to(device) == 0)[:, None, None, :]
    # RoPE is relative, so left padding needs no position shift: positions 0..s-1 give HF's log-probs.
    pos = torch.arange(s, device=device)[None].expand_as(ids)
    return ids, pos, mask
