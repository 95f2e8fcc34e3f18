"""Advantage estimators and return computations.

Conventions (the whole package): per-token tensors are `(B, T)` over response tokens with a `mask` of the same
shape (1 = the token counts, 0 = padding); sequence-level tensors are `(B,)`. Groups are contiguous: rows
`[k*G, (k+1)*G)` are the G samples of prompt k. Values at masked positions never influence a result (NaN
included), and outputs are 0 there.

Contract: pure functions, tensors in and tensors out, no gradient tracking assumed (callers pass detached
rewards and values). Degenerate inputs (a group of one, all-equal rewards, fewer than two valid tokens) give
zero advantages instead of a division blow-up. Sequence scores must be finite: a NaN or inf score is a ValueError
naming its rows (it would otherwise zero its group, or the whole batch, without a word, or give NaN advantages).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "NORM_TYPES",
    "batch_normalized",
    "broadcast_to_tokens",
    "discounted_returns",
    "gae",
    "group_baseline_batch_normalized",
    "group_normalized",
    "leave_one_out",
    "reward_normalized",
    "whiten",
]

#: Choices of `reward_normalized`'s mean and std (ROLL's `norm_mean_type` / `norm_std_type`).
NORM_TYPES = ("group", "batch", "none")


def _check_scores(scores: Tensor) -> None:
    """(B,) and finite. A NaN passes every amax/amin spread test as False (its group, or the batch, would get
    advantage 0 silently) and an inf turns Dr.GRPO's and RLOO's centring into -inf/NaN."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (B,), got shape {tuple(scores.shape)}")
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"scores are not finite at rows {rows[:10]}{' ...' if len(rows) > 10 else ''} "
            f"(values {scores[bad][:10].tolist()}): score non-finite rewards before computing advantages"
        )


def _grouped(scores: Tensor, group_size: int) -> Tensor:
    _check_scores(scores)
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"batch of {scores.numel()} scores does not split into groups of {group_size}")
    return scores.view(-1, group_size)


def _spread(g: Tensor) -> Tensor:
    """(N, 1) bool: whether row n of `g` (N, G) holds two different values. Uniform is decided by comparing values,
    not by a std > 0 test: the float mean of G equal values can be off by an ulp, and (x - mean) / (std + eps)
    then gives every row of the group the same advantage of a few hundredths instead of 0."""
    return g.amax(dim=-1, keepdim=True) > g.amin(dim=-1, keepdim=True)


def group_normalized(scores: Tensor, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantage: (r - group mean) / (group std + eps), std unbiased (N-1).

    With `std_normalize=False` this is Dr.GRPO's mean-only baseline. A group of one, or a group whose rewards are
    all equal, gets advantage 0.

    Args:
        scores: (B,) sequence rewards, B = num_groups * group_size, groups contiguous.
        group_size: G, samples per prompt.
    Returns:
        (B,) advantages.
    """
    g = _grouped(scores, group_size)
    spread = _spread(g)  # all-equal groups: exactly 0 rather than round-off / eps
    centered = torch.where(spread, g - g.mean(dim=-1, keepdim=True), torch.zeros_like(g))
    if not std_normalize:
        return centered.reshape(-1)
    if group_size == 1:
        return torch.zeros_like(scores)
    std = g.std(dim=-1, keepdim=True, unbiased=True)
    adv = torch.where(spread & (std > 0), centered / (std + eps), torch.zeros_like(centered))
    return adv.reshape(-1)


def reward_normalized(
    scores: Tensor, group_size: int, *, mean_type: str = "group", std_type: str = "group", eps: float = 1e-6
) -> Tensor:
    """(r - mean) / (std + eps) with the mean and the std each taken over the group, the batch, or not at all.

    ROLL's `norm_mean_type` / `norm_std_type` choices (`NORM_TYPES`): `mean_type` group subtracts each group's mean,
    batch the batch's mean, none nothing; `std_type` group divides by each group's std, batch by the std of all the
    batch's rewards, none by nothing. Stds are unbiased (N-1) and always of the raw rewards. group/group is GRPO
    (`group_normalized`), group/none Dr.GRPO, group/batch Lite PPO ("Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning": group mean, batch std). Where the divisor is 0 or undefined (all rewards equal, a group or batch of
    one) the advantage is 0, as `group_normalized`'s.

    Args:
        scores: (B,) sequence rewards, groups contiguous.
        group_size: G, samples per prompt (read when either type is group).
        mean_type, std_type: one of `NORM_TYPES`.
    Returns:
        (B,) advantages.
    Raises:
        ValueError: an unknown type, or a batch that does not split into groups of `group_size`.
    """
    for name, kind in (("mean_type", mean_type), ("std_type", std_type)):
        if kind not in NORM_TYPES:
            raise ValueError(f"{name}={kind!r} is not one of {', '.join(NORM_TYPES)}")
    g = _grouped(scores, group_size)  # (num_groups, G); checks the shape even for batch/none
    group_spread = _spread(g)
    batch_spread = _spread(scores.view(1, -1))
    if mean_type == "group":
        centered = torch.where(group_spread, g - g.mean(dim=-1, keepdim=True), torch.zeros_like(g))
    elif mean_type == "batch":
        centered = torch.where(batch_spread, g - scores.mean(), torch.zeros_like(g))
    else:
        centered = g
    if std_type == "none":
        return centered.reshape(-1)
    if std_type == "group":
        std = g.std(dim=-1, keepdim=True, unbiased=True) if group_size > 1 else torch.zeros_like(g[:, :1])
        spread = group_spread
    else:
        std = scores.std(unbiased=True) if scores.numel() > 1 else torch.zeros((), dtype=scores.dtype)
        spread = batch_spread
    std = torch.where(spread, torch.nan_to_num(std, nan=0.0), torch.zeros_like(std)).expand_as(centered)
    adv = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
    return adv.reshape(-1)


def leave_one_out(scores: Tensor, group_size: int) -> Tensor:
    """RLOO advantage: r_i - mean of the other G-1 rewards of its group (0 for a group of one).

    Args:
        scores: (B,) sequence rewards, groups contiguous.
    Returns:
        (B,) advantages; they sum to zero within each group.
    """
    g = _grouped(scores, group_size)
    if group_size == 1:
        return torch.zeros_like(scores)
    others = (g.sum(dim=-1, keepdim=True) - g) / (group_size - 1)
    return torch.where(_spread(g), g - others, torch.zeros_like(g)).reshape(-1)


def batch_normalized(scores: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ advantage: whiten the rewards over the whole batch (unbiased std); 0 for B < 2 or zero std.

    Args:
        scores: (B,) sequence rewards.
    Returns:
        (B,) advantages.
    """
    _check_scores(scores)
    if scores.numel() < 2:
        return torch.zeros_like(scores)
    centered = scores - scores.mean()
    std = scores.std(unbiased=True)
    spread = _spread(scores.view(1, -1)).view(())
    return torch.where(spread & (std > 0), centered / (std + eps), torch.zeros_like(centered))


def group_baseline_batch_normalized(scores: Tensor, group_size: int, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: subtract each group's mean, then whiten over the batch.

    Args:
        scores: (B,) sequence rewards, groups contiguous.
    Returns:
        (B,) advantages.
    """
    return batch_normalized(group_normalized(scores, group_size, std_normalize=False), eps=eps)


def _check_tokens(name: str, x: Tensor, mask: Tensor) -> None:
    if x.shape != mask.shape or x.dim() != 2:
        raise ValueError(f"{name} must be (B, T) like mask {tuple(mask.shape)}, got {tuple(x.shape)}")


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid tokens of each row.

    Masked positions are skipped (not treated as zero-reward steps): the recursion links each valid token to the
    next *valid* token of its row, and the value after the last valid token is 0.

    Args:
        rewards: (B, T) per-token rewards (typically the outcome reward on the last valid token, minus KL).
        values: (B, T) critic values V(s_t).
        mask: (B, T) 1 for valid response tokens.
        gamma: discount; lam: GAE lambda.
    Returns:
        advantages (B, T) and returns = advantages + values (B, T); both 0 at masked positions.
    """
    _check_tokens("rewards", rewards, mask)
    _check_tokens("values", values, mask)
    valid = mask.bool()
    zero = torch.zeros_like(rewards[:, 0])
    rewards = torch.where(valid, rewards, 0.0)
    values = torch.where(valid, values, 0.0)
    advantages = torch.zeros_like(rewards)
    last_gae, next_value = zero, zero
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = valid[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        cur = delta + gamma * lam * last_gae
        advantages[:, t] = torch.where(m, cur, zero)
        last_gae = torch.where(m, cur, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


def discounted_returns(rewards: Tensor, mask: Tensor, *, gamma: float) -> Tensor:
    """Reward-to-go G_t = r_t + gamma * G_{next valid t}, over valid tokens only.

    Args:
        rewards: (B, T); mask: (B, T).
    Returns:
        (B, T) returns, 0 at masked positions.
    """
    _check_tokens("rewards", rewards, mask)
    valid = mask.bool()
    rewards = torch.where(valid, rewards, 0.0)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        cur = rewards[:, t] + gamma * running
        out[:, t] = torch.where(valid[:, t], cur, torch.zeros_like(cur))
        running = torch.where(valid[:, t], cur, running)
    return out


def whiten(x: Tensor, mask: Tensor, *, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """Masked whitening: (x - mean) / sqrt(var + eps) over valid entries (unbiased variance).

    With `shift_mean=False` the mean is added back (scale only). With fewer than two valid entries the valid
    entries are returned unchanged. Valid entries that are all equal give exactly 0 (themselves with
    `shift_mean=False`), not the round-off of their float mean times rsqrt(eps) = 1e4. Masked positions are 0 in the
    output.

    Args:
        x: any shape; mask: same shape.
    Returns:
        tensor of x's shape.
    """
    if x.shape != mask.shape:
        raise ValueError(f"x {tuple(x.shape)} and mask {tuple(mask.shape)} differ in shape")
    valid = mask.bool()
    xs = torch.where(valid, x, 0.0)
    n = valid.sum()
    if n < 2:
        return xs
    # Equal values decided by comparing them (as `_spread`): the mean of 32768 copies of 0.9 is ulps off, which
    # rsqrt(0 + eps) turned into ~3e-3 of same-sign advantage (reinforce_pp on a batch whose rows all scored alike).
    vals = x[valid]
    if bool(vals.amax() == vals.amin()):
        return xs if not shift_mean else torch.zeros_like(xs)
    mean = xs.sum() / n
    var = (torch.where(valid, x - mean, 0.0) ** 2).sum() / (n - 1)
    out = (xs - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, 0.0)


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's value on every valid token of its row.

    Args:
        seq_values: (B,); mask: (B, T).
    Returns:
        (B, T), 0 at masked positions.
    """
    if seq_values.dim() != 1 or mask.dim() != 2 or seq_values.shape[0] != mask.shape[0]:
        raise ValueError(f"seq_values {tuple(seq_values.shape)} must be (B,) for mask {tuple(mask.shape)}")
    return torch.where(mask.bool(), seq_values[:, None].expand_as(mask).to(seq_values.dtype), 0.0)
