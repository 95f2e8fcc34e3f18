"""AsyPPO (Asymmetric PPO, "mini-critics boost LLM reasoning", arXiv 2510.01656): an ensemble of M mini-critics.

The method, as implemented here:
- critic m trains on its own shard of the responses, split *within each prompt group*: every critic sees
  G / M responses of every prompt and no response is seen by two critics (`critic_shards`);
- GAE uses the ensemble's mean value V(s_t) = 1/M sum_m V_m(s_t); the inter-critic disagreement is the
  per-token std across critics, sigma_t = std_m V_m(s_t) (population std, `correction=0`: for M = 2 it is
  |V_1 - V_2| / 2) (`ensemble_values`);
- advantage masking: tokens where the critics agree most (the lowest `agree_fraction` of the batch's valid tokens
  by sigma) get advantage 0 (`agreement_mask`);
- entropy filtering: tokens where they disagree most (the highest `disagree_fraction` by sigma) are left out of the
  entropy bonus (`disagreement_mask`).

Fraction rule (both masks): with N valid tokens and n = floor(fraction * N), the threshold is the (n+1)-th
smallest (resp. largest) sigma, and a token is masked only when its sigma lies strictly below (above) it. So at
most n tokens are masked, exactly n without ties at the threshold, and tied tokens are never split by their
position: when every sigma is equal (identical critics, e.g. before their first update) nothing is masked.
fraction = 0 masks nothing. The percentile is taken over the whole batch passed in (the paper's batch-level rule).

Conventions: those of roll_algos.advantages (per-token tensors (B, T) with a 0/1 `mask`, values at masked
positions never influence a result and outputs are 0 there; groups of `group_size` contiguous rows, or explicit
group ids). Pure functions, no gradient tracking assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_AGREE_FRACTION",
    "DEFAULT_DISAGREE_FRACTION",
    "AsyPPOMasks",
    "agreement_mask",
    "asyppo_masks",
    "critic_shards",
    "disagreement_mask",
    "ensemble_values",
]

#: Share of valid tokens (lowest inter-critic std) whose advantage is masked.
DEFAULT_AGREE_FRACTION = 0.1
#: Share of valid tokens (highest inter-critic std) left out of the entropy bonus.
DEFAULT_DISAGREE_FRACTION = 0.2


def critic_shards(group_ids: Tensor, num_critics: int) -> Tensor:
    """Which critic trains on each row: the responses of every group are dealt round-robin to the critics.

    The j-th row of a group (in batch order) goes to critic j % M, so a group of G = k * M rows gives each critic
    exactly k of its responses, and no row goes to two critics. Deterministic: a batch layout always gives the
    same assignment. For a batch of contiguous groups of G rows pass `torch.arange(B) // G`.

    Args:
        group_ids: (B,) integer id of each row's prompt group (rows of a group need not be contiguous).
        num_critics: M >= 1.
    Returns:
        (B,) long, the critic index of each row.
    """
    if num_critics < 1:
        raise ValueError(f"num_critics={num_critics} must be >= 1")
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D (B,), got shape {tuple(group_ids.shape)}")
    # Rank of each row within its group, in batch order: the count of earlier rows with the same id.
    ids = group_ids.long()
    same = ids.unsqueeze(0) == ids.unsqueeze(1)  # (B, B); batches are thousands of rows at most
    rank = torch.tril(same, diagonal=-1).sum(-1)
    return rank % num_critics


def ensemble_values(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The ensemble's mean value (GAE's V) and the inter-critic std per token.

    Args:
        values: (M, B, T) each critic's value per response token.
        mask: (B, T) 0/1.
    Returns:
        mean (B, T) and std (B, T) over the M critics (population std; 0 when M = 1), both 0 at masked positions.
    """
    if values.dim() != 3 or values.shape[1:] != mask.shape:
        raise ValueError(f"values must be (M, B, T) over mask {tuple(mask.shape)}, got {tuple(values.shape)}")
    valid = mask.bool()
    v = torch.where(valid.unsqueeze(0), values, torch.zeros((), dtype=values.dtype))
    mean = v.mean(0)
    std = v.std(0, correction=0) if values.shape[0] > 1 else torch.zeros_like(mean)
    return mean * valid, std * valid


def _count(fraction: float, n_valid: int, name: str) -> int:
    if not (0.0 <= fraction < 1.0) or math.isnan(fraction):
        raise ValueError(f"{name}={fraction} must lie in [0, 1)")
    return math.floor(fraction * n_valid + 1e-9)


def agreement_mask(std: Tensor, mask: Tensor, fraction: float = DEFAULT_AGREE_FRACTION) -> Tensor:
    """Advantage keep-mask: 0 on the tokens where the critics agree most, 1 on the other valid tokens.

    Args:
        std: (B, T) inter-critic std per token.
        mask: (B, T) 0/1.
        fraction: in [0, 1); the lowest-std share of the valid tokens to mask (fraction rule: module docstring).
    Returns:
        (B, T) float 0/1; 0 at masked positions.
    """
    valid = mask.bool()
    flat = std[valid]
    n = _count(fraction, flat.numel(), "agree_fraction")
    keep = valid.clone()
    if n > 0:
        threshold = flat.sort().values[n]
        keep &= ~(std < threshold)
    return keep.to(std.dtype)


def disagreement_mask(std: Tensor, mask: Tensor, fraction: float = DEFAULT_DISAGREE_FRACTION) -> Tensor:
    """Entropy keep-mask: 0 on the tokens where the critics disagree most, 1 on the other valid tokens.

    Args:
        std: (B, T) inter-critic std per token.
        mask: (B, T) 0/1.
        fraction: in [0, 1); the highest-std share of the valid tokens to leave out of the entropy bonus.
    Returns:
        (B, T) float 0/1; 0 at masked positions.
    """
    valid = mask.bool()
    flat = std[valid]
    n = _count(fraction, flat.numel(), "disagree_fraction")
    keep = valid.clone()
    if n > 0:
        threshold = flat.sort(descending=True).values[n]
        keep &= ~(std > threshold)
    return keep.to(std.dtype)


@dataclass
class AsyPPOMasks:
    """What the policy update needs from the critic ensemble, with the numbers to log."""

    #: (B, T) the ensemble's mean value (GAE's V).
    values: Tensor
    #: (B, T) inter-critic std.
    std: Tensor
    #: (B, T) 0/1, multiplies the advantages.
    advantage_mask: Tensor
    #: (B, T) 0/1, multiplies the per-token entropy of the bonus.
    entropy_mask: Tensor
    #: ensemble_std_mean, advantage_masked_fraction, entropy_masked_fraction (floats over the valid tokens).
    stats: dict[str, float]


def asyppo_masks(
    values: Tensor,
    mask: Tensor,
    *,
    agree_fraction: float = DEFAULT_AGREE_FRACTION,
    disagree_fraction: float = DEFAULT_DISAGREE_FRACTION,
) -> AsyPPOMasks:
    """Ensemble value, std and both masks of one batch from the critics' values (M, B, T) and the mask (B, T)."""
    mean, std = ensemble_values(values, mask)
    adv_keep = agreement_mask(std, mask, agree_fraction)
    ent_keep = disagreement_mask(std, mask, disagree_fraction)
    valid = mask.bool()
    n = max(int(valid.sum()), 1)
    stats = {
        "ensemble_std_mean": float(std[valid].sum()) / n,
        "advantage_masked_fraction": float((valid & (adv_keep == 0)).sum()) / n,
        "entropy_masked_fraction": float((valid & (ent_keep == 0)).sum()) / n,
    }
    return AsyPPOMasks(mean, std, adv_keep, ent_keep, stats)
