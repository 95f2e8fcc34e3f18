"""Attention-based credit: scale the advantages of the tokens the policy's own attention marks as critical.

"Attention Illuminates LLM Reasoning: The Preplan-and-Anchor Rhythm Enables Fine-Grained Policy Optimization"
(ROLL, arXiv 2510.13554). Two metrics read from attention maps:
- Windowed Average Attention Distance of a query row t (locally focused heads): how far back it looks, with each
  distance clipped to a window W: WAAD_t = sum_s a[t, s] * min(t - s, W).
- Future Attention Influence of a key s (globally focused heads): the mean attention it receives from the later
  response rows: FAI_s = mean over response rows t > s of a[t, s].
Heads are told apart by their mean attention distance D_h = mean over response rows of sum_s a[t, s] * (t - s):
the `fraction` of heads with the smallest D are the locally focused ones (WAAD), those with the largest the
globally focused ones (FAI); chosen per row (`select_heads`), the metric averaged over the chosen heads.

Token roles (response tokens; the row that generated token t is row t - 1, whose logits predict it):
- preplan tokens: the model "performs a long-range contextual reference to generate an introductory token": the
  top `ratio` of a response's tokens by the WAAD of their generating row (`generated_by`);
- anchor tokens: the top `ratio` of a response's tokens by FAI;
- coupled: an anchor "immediately followed by or coinciding with" a preplan token: an anchor with a preplan token
  at most `coupling` tokens before it (0: the same token); both members of each coupled pair.
The three strategies (`STRATEGIES`) multiply the advantage of the selected tokens (preplan, anchor, or the coupled
pairs) by `gamma` and leave the others at 1 (`credit_weights`). The paper's exact thresholds could not be read
here (only its abstract and summaries); `DEFAULTS` are this module's, configurable.

Shapes: maps are `(B, H, C, T)` (or `(B, C, T)` for one head): rows of attention probabilities of C query
positions `rows` (C,) over T key positions, causal, each row summing to 1 over its keys; C == T with `rows` None
is the whole map. Row blocks let a caller stream a long sequence in chunks of rows (memory C * T per head):
`waad` and `fai_sums` are per-row and add up over blocks. Per-token tensors are `(B, T)` with a 0/1 `mask` (1 =
a response token), as in `roll_algos.advantages`: values at masked positions never influence a result and
outputs there are 0 (weights 1: they scale nothing). Pure functions, no gradient tracking needed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "DEFAULTS",
    "STRATEGIES",
    "Credit",
    "anchor_tokens",
    "attention_distance",
    "coupled_tokens",
    "credit_weights",
    "fai",
    "fai_sums",
    "future_counts",
    "generated_by",
    "head_distance",
    "head_mean",
    "preplan_tokens",
    "select_heads",
    "top_fraction",
    "waad",
]

#: Which tokens get their advantage scaled: preplan (top WAAD), anchor (top FAI), coupled (anchor + its preplan).
STRATEGIES = ("preplan", "anchor", "coupled")
#: This module's defaults: WAAD window, selected fraction of tokens, advantage factor, coupling distance, heads.
DEFAULTS = {"window": 10, "ratio": 0.2, "gamma": 1.5, "coupling": 1, "head_fraction": 0.25}


class Credit(NamedTuple):
    """Per-token advantage weights (B, T), the boosted tokens (B, T) bool, and their statistics over the mask."""

    weights: Tensor
    boosted: Tensor
    stats: dict[str, Tensor]


def _distances(attn: Tensor, rows: Tensor | None) -> Tensor:
    """(C, T) distance t - s of each query row to each key, >= 0 (keys after the row are masked, probability 0)."""
    c, t = attn.shape[-2], attn.shape[-1]
    if rows is None:
        if c != t:
            raise ValueError(f"a block of {c} rows over {t} keys needs its row positions `rows`")
        rows = torch.arange(t, device=attn.device)
    if rows.shape != (c,):
        raise ValueError(f"rows must be ({c},) positions, got shape {tuple(rows.shape)}")
    keys = torch.arange(t, device=attn.device)
    return (rows.to(attn.device)[:, None] - keys[None, :]).clamp(min=0).to(attn.dtype)


def waad(attn: Tensor, window: int, rows: Tensor | None = None) -> Tensor:
    """Windowed average attention distance of each query row: sum_s a[t, s] * min(t - s, window).

    Args:
        attn: (..., C, T) attention rows at positions `rows` (C,) (None: C == T, the whole map).
        window: W >= 1, the clip of each distance.
    Returns:
        (..., C).
    """
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    return (attn * _distances(attn, rows).clamp(max=window)).sum(-1)


def attention_distance(attn: Tensor, rows: Tensor | None = None) -> Tensor:
    """Unclipped mean attention distance of each query row, sum_s a[t, s] * (t - s): (..., C) of (..., C, T)."""
    return (attn * _distances(attn, rows)).sum(-1)


def fai_sums(attn: Tensor, row_mask: Tensor, rows: Tensor | None = None) -> Tensor:
    """Attention each key receives from the later response rows of a block: sum over rows t > s with row_mask.

    Args:
        attn: (B, H, C, T) or (B, C, T) attention rows at positions `rows` (C,).
        row_mask: (B, C) 0/1, the rows that are response tokens.
    Returns:
        (B, H, T) or (B, T) sums; divided by `future_counts` of the whole sequence they are FAI.
    """
    later = (_distances(attn, rows) > 0).to(attn.dtype)  # (C, T): row t is after key s
    w = row_mask.to(attn.dtype)
    w = w[:, None, :, None] if attn.dim() == 4 else w[:, :, None]
    # Padded rows may hold garbage (NaN): select, never multiply, them away.
    return torch.where((w * later) > 0, attn, torch.zeros((), dtype=attn.dtype, device=attn.device)).sum(-2)


def future_counts(mask: Tensor) -> Tensor:
    """(B, T) number of response tokens after each position (the FAI denominator)."""
    m = mask.to(torch.float32)
    return m.flip(-1).cumsum(-1).flip(-1) - m


def fai(attn: Tensor, mask: Tensor) -> Tensor:
    """Future attention influence of each response token from a whole map: mean over later response rows.

    Args:
        attn: (B, H, T, T) or (B, T, T).
        mask: (B, T) 0/1 response tokens (rows and keys).
    Returns:
        (B, H, T) or (B, T); 0 at masked keys and at keys with no later response token.
    """
    sums = fai_sums(attn, mask)
    counts, key = future_counts(mask), mask > 0
    if attn.dim() == 4:
        counts, key = counts[:, None], key[:, None]
    return torch.where(key & (counts > 0), sums / counts.clamp(min=1).to(sums.dtype), torch.zeros_like(sums))


def generated_by(row_values: Tensor) -> Tensor:
    """(..., T) the value of the row that generated each token (row t - 1 for token t; 0 for token 0)."""
    return torch.nn.functional.pad(row_values[..., :-1], (1, 0))


def head_distance(attn: Tensor, mask: Tensor) -> Tensor:
    """(B, H) each head's mean attention distance over the rows that generated the response tokens.

    Args:
        attn: (B, H, T, T) whole maps.
        mask: (B, T) 0/1 response tokens.
    """
    rows = generated_by(attention_distance(attn))  # (B, H, T): the generating row's distance, per token
    m = mask.to(rows.dtype)[:, None]
    return torch.where(m > 0, rows, torch.zeros_like(rows)).sum(-1) / m.sum(-1).clamp(min=1)


def select_heads(distance: Tensor, fraction: float, *, local: bool) -> Tensor:
    """Per row, the ceil(fraction * H) heads with the smallest (`local`) or largest mean attention distance.

    Args:
        distance: (B, H) each head's mean attention distance over the row's response tokens.
        fraction: in (0, 1]; 1 keeps every head.
    Returns:
        (B, H) bool. Ties go to the lower head index.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"head fraction={fraction} must lie in (0, 1]")
    h = distance.shape[-1]
    k = max(1, math.ceil(fraction * h - 1e-9))
    key = distance if local else -distance
    order = torch.sort(key, dim=-1, stable=True).indices
    picked = torch.zeros_like(distance, dtype=torch.bool)
    return picked.scatter(-1, order[..., :k], True)


def head_mean(per_head: Tensor, heads: Tensor) -> Tensor:
    """(B, T) mean over the chosen heads (B, H) bool of a per-head metric (B, H, T)."""
    w = heads.to(per_head.dtype)[..., None]
    return (per_head * w).sum(1) / w.sum(1).clamp(min=1)


def top_fraction(score: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """Per row, the ceil(ratio * n) highest-scoring of its n response tokens (ties: the earlier token).

    Args:
        score: (B, T).
        mask: (B, T) 0/1.
        ratio: in (0, 1].
    Returns:
        (B, T) bool, False at masked positions.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio={ratio} must lie in (0, 1]")
    valid = mask > 0
    n = valid.sum(-1, keepdim=True)
    k = torch.ceil(n.to(torch.float64) * ratio - 1e-9).to(n.dtype)
    key = torch.where(valid, score.to(torch.float64), torch.full_like(score, -math.inf, dtype=torch.float64))
    order = torch.sort(-key, dim=-1, stable=True).indices
    positions = torch.arange(score.shape[-1], device=score.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)  # rank of each token in its row
    return valid & (rank < k)


def preplan_tokens(token_waad: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """(B, T) bool preplan tokens: the top `ratio` of each response's tokens by the WAAD of their generating row
    (`token_waad` = `generated_by` of the rows' WAAD)."""
    return top_fraction(token_waad, mask, ratio)


def anchor_tokens(token_fai: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """(B, T) bool anchor tokens: the top `ratio` of each response's tokens by FAI."""
    return top_fraction(token_fai, mask, ratio)


def coupled_tokens(preplan: Tensor, anchor: Tensor, coupling: int) -> Tensor:
    """(B, T) bool: every anchor with a preplan token at most `coupling` tokens before it (or on it), and every
    preplan token with an anchor at most `coupling` tokens after it (or on it)."""
    if coupling < 0:
        raise ValueError(f"coupling={coupling} must be >= 0")
    t = preplan.shape[-1]
    anchor_paired = torch.zeros_like(anchor)
    preplan_paired = torch.zeros_like(preplan)
    for d in range(min(coupling, t - 1) + 1):
        # pairs (preplan at i, anchor at i + d)
        pair = preplan[..., : t - d] & anchor[..., d:]
        anchor_paired[..., d:] |= pair
        preplan_paired[..., : t - d] |= pair
    return anchor_paired | preplan_paired


def credit_weights(
    strategy: str,
    token_waad: Tensor,
    token_fai: Tensor,
    mask: Tensor,
    *,
    ratio: float = DEFAULTS["ratio"],
    gamma: float = DEFAULTS["gamma"],
    coupling: int = DEFAULTS["coupling"],
) -> Credit:
    """Advantage weights of one strategy: `gamma` on the boosted tokens, 1 elsewhere.

    Args:
        strategy: one of `STRATEGIES`.
        token_waad: (B, T) WAAD of the row that generated each token (`generated_by` of the rows' WAAD).
        token_fai: (B, T) FAI of each token.
        mask: (B, T) 0/1 response tokens.
        ratio: fraction of each response's tokens selected as preplan / anchor tokens.
        gamma: factor of a boosted token's advantage (> 1 amplifies, whichever the advantage's sign).
        coupling: `coupled_tokens`' distance.
    Returns:
        Credit(weights (B, T), boosted (B, T) bool, stats {"boosted_fraction", "weight_mean"} over the mask).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    if not (math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"gamma={gamma} must be a finite number > 0")
    if strategy == "preplan":
        boosted = preplan_tokens(token_waad, mask, ratio)
    elif strategy == "anchor":
        boosted = anchor_tokens(token_fai, mask, ratio)
    else:
        pre, anc = preplan_tokens(token_waad, mask, ratio), anchor_tokens(token_fai, mask, ratio)
        boosted = coupled_tokens(pre, anc, coupling)
    boosted = boosted & (mask > 0)
    weights = torch.where(boosted, torch.full_like(token_fai, gamma, dtype=torch.float32), 1.0)
    m = mask.to(torch.float32)
    n = m.sum().clamp(min=1)
    stats = {"boosted_fraction": boosted.float().sum() / n, "weight_mean": (weights * m).sum() / n}
    return Credit(weights, boosted, stats)
