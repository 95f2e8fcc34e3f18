"""Rollout/training agreement: weights for tokens sampled by an engine whose log-probs differ from the trainer's.

The ratio is r = pi_old / pi_behaviour per token, with pi_old the trainer's log-probs of the sampled tokens (its copy
of the rollout policy, before any update) and pi_behaviour those the inference engine reported while sampling. With
identical numerics r = 1; a bf16 engine, a different kernel, stale weights or MoE routing that differs make r drift.
Each correction below turns r into a detached (B, T) weight to multiply into the per-token policy-gradient loss:
- `token_mask` (masked IS, token level): 1 where low <= r_t <= high, else 0 (the token gets no gradient).
- `sequence_mask` (masked IS, sequence level): 1 on every token of a row whose product ratio
  exp(sum_t log r_t) lies in [low, high], else 0 on the whole row.
- `icepop` (IcePop, Ring-1T, arXiv 2510.18855): the masking function M(r; a, b) = r where a <= r <= b, else 0, per
  token: tokens inside the band keep their importance weight (calibration), tokens outside get zero gradient
  (masked, not clipped).
- `geo_mask` (geometric-mean sequence masking): 1 on every token of a row whose geometric-mean ratio
  exp(mean_t log r_t) lies in [low, high], else 0. Length-normalised, so it needs bounds close to 1.

Bounds are inclusive. `DEFAULT_BOUNDS` holds the papers' and their reference implementations' values (verl's
rollout rejection sampling 0.5..2 for token and sequence masks and 0.999..1.001 for the geometric mean; IcePop's
a = 0.5, b = 5). Masked tokens keep their place in the loss's normaliser, as in IcePop's 1/sum_i |y_i|: masking
many tokens does not enlarge the step of the rest.

`ratio_stats` describes the distribution of r over the response tokens (quantiles, extremes, mean |log r|), for
logging every step whichever correction is on.

Conventions as in `roll_algos.advantages`: per-token `(B, T)` with a 0/1 `mask`; values at masked positions never
influence a result (NaN and inf included) and weights are 0 there. Token log-ratios are clamped to +-20 before exp
(as `roll_algos.losses.bounded_log_ratio`); a row's log ratio (sequence_mask, geo_mask) is summed from the unclamped
ones, so that clamped tokens cannot offset one another. Bounds are compared in log space, so nothing overflows in
fp32. A token whose ratio is undefined (both log-probs -inf) is dropped, and so is every token of its row at
sequence level.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "CORRECTIONS",
    "DEFAULT_BOUNDS",
    "Correction",
    "correction_weights",
    "geo_mask",
    "icepop",
    "ratio_stats",
    "resolve_bounds",
    "sequence_mask",
    "token_mask",
]

#: The masking corrections, by the name `algo.off_policy_correction` takes.
CORRECTIONS = ("token_mask", "sequence_mask", "icepop", "geo_mask")
#: (low, high) when the config leaves a bound null.
DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {
    "token_mask": (0.5, 2.0),
    "sequence_mask": (0.5, 2.0),
    "icepop": (0.5, 5.0),
    "geo_mask": (0.999, 1.001),
}
_MAX_LOG_RATIO = 20.0
_QUANTILES = (("p5", 0.05), ("p50", 0.5), ("p95", 0.95))


class Correction(NamedTuple):
    """A correction's result: the weights to multiply into the per-token loss, and what they did."""

    #: (B, T) detached weights, 0 at padding and at masked tokens.
    weights: Tensor
    #: 0-dim detached: `masked_fraction` (valid tokens given weight 0), `masked_seq_fraction` (rows with tokens that
    #: lost at least one), `above_fraction` / `below_fraction` (valid tokens whose tested ratio, the token's or its
    #: row's, is above high / below low).
    stats: dict[str, Tensor]


def resolve_bounds(name: str, low: float | None = None, high: float | None = None) -> tuple[float, float]:
    """The (low, high) band of correction `name`, a null bound taking `DEFAULT_BOUNDS[name]`'s.

    Raises:
        ValueError: unknown `name`, or bounds that are not finite with 0 < low <= 1 <= high and low < high (a band
            that excludes r = 1 would mask the tokens on which engine and trainer agree).
    """
    if name not in DEFAULT_BOUNDS:
        raise ValueError(f"unknown correction {name!r}; choose one of {', '.join(CORRECTIONS)}")
    d_low, d_high = DEFAULT_BOUNDS[name]
    lo = d_low if low is None else float(low)
    hi = d_high if high is None else float(high)
    if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 < lo <= 1.0 <= hi and lo < hi):
        raise ValueError(
            f"{name} bounds [{lo}, {hi}] must be finite with 0 < low <= 1 <= high and low < high "
            f"(its defaults are [{d_low}, {d_high}])"
        )
    return lo, hi


def _log_ratio(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(log r clamped to +-20, 0 at padding; bool mask)."""
    if old_logp.shape != mask.shape or behaviour_logp.shape != mask.shape or mask.dim() != 2:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)}, behaviour_logp {tuple(behaviour_logp.shape)} and mask "
            f"{tuple(mask.shape)} must all be (B, T)"
        )
    valid = mask.bool()
    lr = torch.where(valid, old_logp.detach().float() - behaviour_logp.detach().float(), 0.0)
    # A token both policies give probability 0 (-inf - -inf) has no ratio: as the largest one, so that every band
    # drops it (a NaN passed every band test, and its weight exp(NaN) poisoned the loss).
    lr = torch.nan_to_num(lr, nan=_MAX_LOG_RATIO)
    return torch.clamp(lr, -_MAX_LOG_RATIO, _MAX_LOG_RATIO), valid


def _row_log_ratio(old_logp: Tensor, behaviour_logp: Tensor, valid: Tensor, *, mean: bool) -> Tensor:
    """A row's log ratio, sum_t log r_t (or its mean over the valid tokens), on each of its tokens: (B, T).

    Summed from the unclamped token log ratios: clamping each to +-20 first let tokens offset one another (log r of
    +25 and -21 summed to 0, a row whose ratio is e^4 passed a [0.5, 2] band), and a token without a ratio (NaN,
    counted as +20) could be cancelled by a -20 and its row kept. Here a row holding a token whose ratio is 0 or
    infinite has a log ratio of -inf or +inf, and a row with a token without a ratio (or both) gets +inf: every band
    drops it. Compared with the band in log space, so nothing is exponentiated.
    """
    raw = torch.where(valid, old_logp.detach().float() - behaviour_logp.detach().float(), 0.0)
    row = raw.sum(-1, keepdim=True)
    if mean:
        row = row / valid.sum(-1, keepdim=True).clamp_min(1)
    row = torch.nan_to_num(row, nan=math.inf, posinf=math.inf, neginf=-math.inf)
    return row.expand_as(raw)


def _band(tested: Tensor, valid: Tensor, low: float, high: float, keep_value: Tensor | None) -> Correction:
    """Weights of a band test on `tested` (log ratios, (B, T), a row's value repeated on its tokens for sequence
    corrections): `keep_value` (or 1) inside [log low, log high], 0 outside and at padding."""
    above = tested > math.log(high)
    below = tested < math.log(low)
    keep = valid & ~above & ~below
    ones = torch.ones_like(tested)
    weights = torch.where(keep, ones if keep_value is None else keep_value, 0.0)
    n_tok = valid.sum().clamp_min(1)
    dropped = valid & ~keep
    rows = valid.any(-1)
    stats = {
        "masked_fraction": dropped.sum() / n_tok,
        "masked_seq_fraction": (dropped.any(-1) & rows).sum() / rows.sum().clamp_min(1),
        "above_fraction": (valid & above).sum() / n_tok,
        "below_fraction": (valid & below).sum() / n_tok,
    }
    return Correction(weights, {k: v.float() for k, v in stats.items()})


def token_mask(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, low: float, high: float) -> Correction:
    """Masked IS at token level: weight 1 where low <= r_t <= high, else 0; r_t = exp(old_logp - behaviour_logp).

    Args:
        old_logp: (B, T) the trainer's log-probs of the sampled tokens.
        behaviour_logp: (B, T) the inference engine's log-probs of the same tokens.
        mask: (B, T) 0/1 response tokens.
        low, high: the inclusive band of accepted ratios.
    Returns:
        `Correction` with (B, T) 0/1 weights.
    """
    lr, valid = _log_ratio(old_logp, behaviour_logp, mask)
    return _band(lr, valid, low, high, None)


def sequence_mask(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, low: float, high: float) -> Correction:
    """Masked IS at sequence level: weight 1 on the tokens of rows whose ratio prod_t r_t = exp(sum_t log r_t) lies
    in [low, high], 0 on every token of the other rows.

    Args:
        old_logp, behaviour_logp, mask: (B, T), as in `token_mask`.
        low, high: the inclusive band of accepted sequence ratios.
    Returns:
        `Correction` with (B, T) 0/1 weights, constant along each row's valid tokens.
    """
    _, valid = _log_ratio(old_logp, behaviour_logp, mask)
    seq = _row_log_ratio(old_logp, behaviour_logp, valid, mean=False)
    return _band(seq, valid, low, high, None)


def icepop(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, low: float, high: float) -> Correction:
    """IcePop (Ring-1T, arXiv 2510.18855): M(r_t; low, high) = r_t where low <= r_t <= high, else 0.

    Two-sided token masking that keeps the importance weight inside the band: the loss of an accepted token is
    calibrated by r_t, a token whose engine and trainer probabilities disagree beyond the band gets no gradient.
    The paper's a = 0.5, b = 5 are the defaults (`DEFAULT_BOUNDS`).

    Args:
        old_logp, behaviour_logp, mask: (B, T), as in `token_mask`.
        low, high: a and b, the inclusive band.
    Returns:
        `Correction` with (B, T) weights in {0} u [low, high].
    """
    lr, valid = _log_ratio(old_logp, behaviour_logp, mask)
    return _band(lr, valid, low, high, torch.exp(lr))


def geo_mask(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, low: float, high: float) -> Correction:
    """Geometric-mean sequence masking: weight 1 on the tokens of rows whose exp(mean_t log r_t) (mean over the
    row's valid tokens) lies in [low, high], 0 on every token of the other rows.

    Args:
        old_logp, behaviour_logp, mask: (B, T), as in `token_mask`.
        low, high: the inclusive band of accepted geometric-mean ratios (close to 1: 0.999 and 1.001 by default).
    Returns:
        `Correction` with (B, T) 0/1 weights, constant along each row's valid tokens.
    """
    _, valid = _log_ratio(old_logp, behaviour_logp, mask)
    mean = _row_log_ratio(old_logp, behaviour_logp, valid, mean=True)
    return _band(mean, valid, low, high, None)


_FUNCTIONS = {"token_mask": token_mask, "sequence_mask": sequence_mask, "icepop": icepop, "geo_mask": geo_mask}


def correction_weights(
    name: str,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> Correction:
    """The correction `name` (one of `CORRECTIONS`) with its bounds resolved by `resolve_bounds`.

    Args:
        name: token_mask | sequence_mask | icepop | geo_mask.
        old_logp, behaviour_logp, mask: (B, T), as in `token_mask`.
        low, high: the band; None takes the correction's default.
    Returns:
        `Correction`.
    Raises:
        ValueError: unknown `name` or bad bounds.
    """
    lo, hi = resolve_bounds(name, low, high)
    return _FUNCTIONS[name](old_logp, behaviour_logp, mask, low=lo, high=hi)


def _quantile(sorted_x: Tensor, q: float) -> Tensor:
    """Linear-interpolation quantile of a sorted 1-D tensor (torch.quantile's default, without its 2^24 cap)."""
    pos = q * (sorted_x.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, sorted_x.numel() - 1)
    return sorted_x[lo] + (pos - lo) * (sorted_x[hi] - sorted_x[lo])


def ratio_stats(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The distribution of r = exp(old_logp - behaviour_logp) over the response tokens.

    Quantiles interpolate linearly between order statistics (as `torch.quantile`). With no valid token every ratio
    statistic is 1 (no gap) and `abs_log_ratio_mean` 0.

    Args:
        old_logp, behaviour_logp, mask: (B, T), as in `token_mask`.
    Returns:
        0-dim detached fp32 tensors: `ratio_p5`, `ratio_p50`, `ratio_p95`, `ratio_max`, `ratio_min`,
        `abs_log_ratio_mean` (mean |log r|, log r clamped to +-20 as `_log_ratio` does).
    """
    lr, valid = _log_ratio(old_logp, behaviour_logp, mask)
    r = torch.exp(lr[valid])
    if r.numel() == 0:
        one, zero = torch.ones((), device=lr.device), torch.zeros((), device=lr.device)
        return {
            **{f"ratio_{k}": one for k, _ in _QUANTILES},
            "ratio_max": one,
            "ratio_min": one,
            "abs_log_ratio_mean": zero,
        }
    s = torch.sort(r).values
    out = {f"ratio_{k}": _quantile(s, q) for k, q in _QUANTILES}
    out["ratio_max"], out["ratio_min"] = s[-1], s[0]
    out["abs_log_ratio_mean"] = lr[valid].abs().mean()
    return out
