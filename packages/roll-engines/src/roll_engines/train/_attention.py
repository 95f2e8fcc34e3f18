"""Attention maps of the response rows, read during a no-grad forward, for attention-based credit
(roll_algos.attention_credit: WAAD, FAI, preplan / anchor tokens).

How: the model runs once with its attention implementation switched to `CAPTURE`, a function registered in
transformers' AttentionInterface that computes every layer's output with SDPA (as the `sdpa` implementation, same
mask) and, on the layers asked for, also the softmax probabilities softmax(q k^T * scaling + mask) of the rows that
matter (positions P-1 .. P+R-1 of a (b, P+R) micro-batch: the rows that generate the response tokens, and the
response tokens' own rows), in blocks of `chunk_rows` rows. Each block is reduced at once (roll_algos'
row-block functions), so memory is b * heads * chunk_rows * (P+R) floats for one layer at a time, never a whole
(P+R)^2 map per head per layer. The implementation is restored when the forward ends (an exception included).

Only plain softmax attention is read: a layer with logit soft-capping or attention sinks (Gemma 2, gpt-oss) is
refused with a ValueError, as is a model whose attention modules carry no `layer_idx`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from roll_algos import attention_credit as AC

CAPTURE = "roll_attention_capture"
_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("roll_attention_recorder", default=None)


def _capture_forward(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kw: Any):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.observe(module, query, key, attention_mask, kw.get("scaling"), kw.get("softcap"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE, _capture_forward)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)  # the masks `sdpa` gets: bool (b, 1, L, L) or None


def resolve_layers(layers: list[int], num_layers: int) -> list[int]:
    """Layer indices (negative from the top; empty: the middle layer), checked, sorted, unique."""
    picked = list(layers) or [num_layers // 2]
    out = set()
    for i in picked:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ValueError(f"attention layer {i} does not exist: the model has {num_layers} layers")
        out.add(j)
    return sorted(out)


@dataclass
class _Recorder:
    """Per-layer reductions of one micro-batch's response rows (or, with `keep_maps`, the rows themselves)."""

    layers: list[int]
    prompt_len: int
    response_mask: Tensor  # (b, R)
    window: int
    chunk_rows: int
    keep_maps: bool = False
    waad: dict[int, Tensor] = field(default_factory=dict)  # layer -> (b, H, R): WAAD of the generating rows
    distance: dict[int, Tensor] = field(default_factory=dict)  # layer -> (b, H, R): their attention distance
    fai_sums: dict[int, Tensor] = field(default_factory=dict)  # layer -> (b, H, R): from later response rows
    maps: dict[int, Tensor] = field(default_factory=dict)  # layer -> (b, H, R + 1, P + R), keep_maps only

    def observe(
        self, module: Any, query: Tensor, key: Tensor, mask: Tensor | None, scaling: float | None, softcap: Any
    ) -> None:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(f"{type(module).__name__} has no layer_idx: its attention maps cannot be told apart")
        if layer not in self.layers:
            return
        if softcap is not None or getattr(module, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                f"{type(module).__name__} soft-caps its attention logits: attention credit reads plain softmax"
            )
        if getattr(module, "sinks", None) is not None:
            raise ValueError(f"{type(module).__name__} has attention sinks: attention credit reads plain softmax")
        b, h, length, d = query.shape
        p, r = self.prompt_len, self.response_mask.shape[1]
        if length != p + r:
            raise ValueError(f"attention over {length} positions, expected prompt {p} + response {r}")
        scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
        k = key.float().repeat_interleave(h // key.shape[1], dim=1)  # grouped-query heads share their key
        resp = self.response_mask.to(query.device).float()
        waad = torch.zeros(b, h, r, device=query.device)
        dist = torch.zeros(b, h, r, device=query.device)
        fai = torch.zeros(b, h, r, device=query.device)
        maps = []
        # Rows P-1 .. P+R-1: row P-1+i generates response token i; rows P.. are the response tokens themselves.
        for start in range(p - 1, p + r, self.chunk_rows):
            stop = min(start + self.chunk_rows, p + r)
            rows = torch.arange(start, stop, device=query.device)
            scores = torch.matmul(query[:, :, start:stop].float(), k.transpose(-1, -2)) * scale  # (b, H, C, L)
            if mask is None:  # no padding: plain causal
                allowed = rows[:, None] >= torch.arange(length, device=query.device)[None, :]
                scores = scores.masked_fill(~allowed, -math.inf)
            elif mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask[:, :, start:stop], -math.inf)
            else:
                scores = scores + mask[:, :, start:stop].float()
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row is no attention
            if self.keep_maps:
                maps.append(probs.cpu())
            gen = rows < p + r - 1  # rows that generate a response token: token index = row - (P - 1)
            if gen.any():
                g = slice(int(rows[gen][0]) - p + 1, int(rows[gen][-1]) - p + 2)
                waad[:, :, g] = AC.waad(probs[:, :, gen], self.window, rows[gen])
                dist[:, :, g] = AC.attention_distance(probs[:, :, gen], rows[gen])
            own = rows >= p  # response rows attending to response keys (key index = position - P)
            if own.any():
                row_mask = resp[:, (rows[own] - p)]
                fai += AC.fai_sums(probs[:, :, own][..., p:], row_mask, rows[own] - p)
        self.waad[layer], self.distance[layer], self.fai_sums[layer] = waad.cpu(), dist.cpu(), fai.cpu()
        if self.keep_maps:
            self.maps[layer] = torch.cat(maps, dim=2)

    def token_scores(self, head_fraction: float) -> dict[str, Tensor]:
        """{"waad", "fai"} (b, R): WAAD of each token's generating row over the most local heads, FAI over the
        most global ones, heads pooled over the read layers and chosen per row by mean attention distance."""
        mask = self.response_mask.float()
        missing = [i for i in self.layers if i not in self.waad]
        if missing:
            raise ValueError(f"layers {missing} ran no attention: is the model's attention AttentionInterface-based?")
        waad = torch.cat([self.waad[i] for i in self.layers], 1)  # (b, L*H, R)
        dist = torch.cat([self.distance[i] for i in self.layers], 1)
        fai = torch.cat([self.fai_sums[i] for i in self.layers], 1)
        m = mask[:, None]
        head_dist = torch.where(m > 0, dist, 0.0).sum(-1) / m.sum(-1).clamp(min=1)  # (b, L*H)
        local = AC.select_heads(head_dist, head_fraction, local=True)
        glob = AC.select_heads(head_dist, head_fraction, local=False)
        counts = AC.future_counts(mask)[:, None]
        fai = torch.where((m > 0) & (counts > 0), fai / counts.clamp(min=1), 0.0)
        return {"waad": AC.head_mean(waad, local) * mask, "fai": AC.head_mean(fai, glob) * mask}


_registered = False


@contextlib.contextmanager
def capturing(model: torch.nn.Module, recorder: _Recorder) -> Iterator[None]:
    """Run `model`'s forwards inside with the capture implementation and `recorder`; restores the model's own."""
    global _registered
    if not _registered:
        _register()
        _registered = True
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    if model.config._attn_implementation != CAPTURE:
        raise ValueError(
            f"{type(model).__name__} cannot switch its attention implementation (not AttentionInterface-based): "
            "attention credit cannot read its maps"
        )
    token = _RECORDER.set(recorder)
    try:
        yield
    finally:
        _RECORDER.reset(token)
        model.set_attn_implementation(previous)


def micro_recorder(
    micro: dict[str, Tensor], layers: list[int], window: int, chunk_rows: int, keep_maps: bool = False
) -> _Recorder:
    """A recorder for one padded micro-batch of the roll_core.protocol layout."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1")
    r = micro["responses"].shape[1]
    p = micro["input_ids"].shape[1] - r
    if p < 1:
        raise ValueError("attention credit needs at least one prompt position (the row generating token 0)")
    return _Recorder(layers, p, micro["response_mask"].float(), window, chunk_rows, keep_maps)
