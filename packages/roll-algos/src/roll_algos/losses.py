"""Policy and value losses, loss aggregation, entropy, off-policy weights and the DAPO overlong penalty.

Conventions as in `roll_algos.advantages`: per-token `(B, T)` with a 0/1 `mask`, sequence-level `(B,)`.
Masked positions never influence a loss or its gradient, whatever they hold (NaN and inf included): inputs are
sanitised with `torch.where` before any arithmetic, so no NaN reaches the backward pass either.

Aggregation modes (`aggregate`), with m the mask and L the per-token loss:
- `token-mean`: sum(L*m) / sum(m)  (0 when no token is valid)
- `seq-mean-token-mean`: mean over sequences with >= 1 valid token of (sum_t L*m / sum_t m)
- `seq-mean-token-sum`: mean over all B sequences of sum_t L*m
- `seq-mean-token-sum-norm` (Dr.GRPO): sum(L*m) / (B * norm_length)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "AGG_MODES",
    "POLICY_LOSS_VARIANTS",
    "aggregate",
    "entropy_from_logits",
    "masked_mean",
    "off_policy_weights",
    "overlong_penalty",
    "policy_loss",
    "token_logprobs",
    "value_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_LOSS_VARIANTS = ("ppo", "gspo", "cispo", "tis", "topr", "vanilla")
# Bound on |log ratio| before exp: beyond this the ratio is clipped anyway, and exp would overflow in fp32.
_MAX_LOG_RATIO = 20.0


def _valid(mask: Tensor, like: Tensor) -> Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match tensor {tuple(like.shape)}")
    return mask.bool()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over valid entries (0 when none); masked values never contribute. Returns a 0-dim tensor."""
    valid = _valid(mask, x)
    return torch.where(valid, x, 0.0).sum() / valid.sum().clamp_min(1)


def aggregate(loss: Tensor, mask: Tensor, mode: str = "token-mean", *, norm_length: int | None = None) -> Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss: (B, T) per-token loss.
        mask: (B, T) 0/1.
        mode: one of `AGG_MODES` (see the module docstring for formulas).
        norm_length: the constant length for `seq-mean-token-sum-norm` (e.g. the max response length).
    Returns:
        0-dim tensor; finite whenever the valid entries are finite (all-masked input gives 0).
    """
    valid = _valid(mask, loss)
    if loss.dim() != 2:
        raise ValueError(f"loss must be (B, T), got {tuple(loss.shape)}")
    lm = torch.where(valid, loss, 0.0)
    if mode == "token-mean":
        return lm.sum() / valid.sum().clamp_min(1)
    if mode == "seq-mean-token-mean":
        counts = valid.sum(dim=-1)
        per_seq = lm.sum(dim=-1) / counts.clamp_min(1)
        has_tokens = counts > 0
        return torch.where(has_tokens, per_seq, 0.0).sum() / has_tokens.sum().clamp_min(1)
    if mode == "seq-mean-token-sum":
        return lm.sum(dim=-1).sum() / max(loss.shape[0], 1)
    if mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (e.g. the max response length)")
        return lm.sum() / (max(loss.shape[0], 1) * norm_length)
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {', '.join(AGG_MODES)}")


def _seq_mean(x: Tensor, valid: Tensor) -> Tensor:
    """(B, T) -> (B,) masked mean per row (0 for empty rows)."""
    return torch.where(valid, x, 0.0).sum(-1) / valid.sum(-1).clamp_min(1)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    variant: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
    ratio_cap: float = 2.0,
    positive: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient loss of the PPO family.

    Variants (r = exp(logp - old_logp), A the advantage, sg = stop-gradient):
    - `ppo`: max(-A r, -A clip(r, 1-clip_low, 1+clip_high)); clip_high > clip_low is DAPO clip-higher;
      `dual_clip=c` (c > 1) bounds the loss of negative-advantage tokens at c|A|.
    - `gspo`: like `ppo` but with the sequence ratio exp(masked mean of log r), gradient through the mean.
    - `cispo`: -sg(clip(r, 1-clip_low, 1+clip_high)) A logp.
    - `tis`: -sg(min(r, ratio_cap)) A logp (truncated importance sampling).
    - `topr`: rows with positive reward: -A logp; others: -sg(clip(r, 0, 1)) A logp.
    - `vanilla`: -A logp.

    Args:
        logp: (B, T) log-probs of the sampled tokens under the current policy (with grad).
        old_logp: (B, T) log-probs under the policy that produced the rollout (no grad needed).
        advantages: (B, T) per-token, or (B,) per sequence (broadcast to the valid tokens).
        mask: (B, T) 0/1.
        positive: (B,) bool, rows with positive reward for `topr`; default: masked mean advantage > 0.
    Returns:
        (loss, metrics): a 0-dim loss aggregated with `agg`; metrics are detached 0-dim tensors:
        `clipfrac_low`, `clipfrac_high`, `clipfrac_dual`, `approx_kl` (k3 between old and new, masked mean),
        `ratio_mean`, `ratio_max`.
    """
    valid = _valid(mask, logp)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    if old_logp.shape != logp.shape or advantages.shape != logp.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and advantages "
            f"{tuple(advantages.shape)} must all be (B, T)"
        )
    logp = torch.where(valid, logp, 0.0)
    old_logp = torch.where(valid, old_logp.detach(), 0.0)
    adv = torch.where(valid, advantages.detach(), 0.0)
    log_ratio = torch.clamp(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)

    zeros = torch.zeros((), dtype=logp.dtype, device=logp.device)
    clip_lo_frac, clip_hi_frac, dual_frac = zeros, zeros, zeros
    if variant in ("ppo", "gspo"):
        if variant == "gspo":
            seq_log_ratio = _seq_mean(log_ratio, valid)
            ratio = torch.exp(seq_log_ratio)[:, None].expand_as(logp)
        else:
            ratio = torch.exp(log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        loss = torch.maximum(unclipped, clipped)
        clip_lo_frac = masked_mean(((ratio < 1.0 - clip_low) & (adv < 0)).to(logp.dtype), mask)
        clip_hi_frac = masked_mean(((ratio > 1.0 + clip_high) & (adv > 0)).to(logp.dtype), mask)
        if dual_clip is not None:
            if dual_clip <= 1.0:
                raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
            bound = -adv * dual_clip  # positive where adv < 0
            dual_active = (adv < 0) & (loss > bound)
            loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
            dual_frac = masked_mean(dual_active.to(logp.dtype), mask)
    else:
        ratio = torch.exp(log_ratio)
        if variant == "vanilla":
            weight = torch.ones_like(ratio)
        elif variant == "cispo":
            weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        elif variant == "tis":
            weight = torch.clamp(ratio, 0.0, ratio_cap)
        elif variant == "topr":
            if positive is None:
                positive = _seq_mean(adv, valid) > 0
            weight = torch.where(positive[:, None], torch.ones_like(ratio), torch.clamp(ratio, 0.0, 1.0))
        else:
            raise ValueError(f"unknown policy loss {variant!r}; choose one of {', '.join(POLICY_LOSS_VARIANTS)}")
        loss = -weight.detach() * adv * logp
    total = aggregate(loss, mask, agg, norm_length=norm_length)
    with torch.no_grad():
        approx_kl = masked_mean(torch.exp(-log_ratio) + log_ratio - 1.0, mask)
        ratio_valid = torch.where(valid, ratio, 0.0)
        metrics = {
            "clipfrac_low": clip_lo_frac.detach(),
            "clipfrac_high": clip_hi_frac.detach(),
            "clipfrac_dual": dual_frac.detach(),
            "approx_kl": approx_kl,
            "ratio_mean": masked_mean(ratio.detach(), mask),
            "ratio_max": ratio_valid.max() if valid.any() else zeros,
        }
    return total, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO value loss 0.5 * (V - R)^2, or with `clip` the max of that and the clipped-value error.

    Args:
        values: (B, T) current critic values (with grad); old_values: (B, T) values at rollout time;
        returns: (B, T) targets; mask: (B, T).
    Returns:
        (loss, metrics) with metrics `vf_clipfrac` (fraction of tokens where the clipped branch is larger).
    """
    valid = _valid(mask, values)
    v = torch.where(valid, values, 0.0)
    r = torch.where(valid, returns.detach(), 0.0)
    err = (v - r).square()
    clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    if clip is not None:
        old = torch.where(valid, old_values.detach(), 0.0)
        v_clipped = old + torch.clamp(v - old, -clip, clip)
        err_clipped = (v_clipped - r).square()
        clipfrac = masked_mean((err_clipped > err).to(values.dtype), mask).detach()
        err = torch.maximum(err, err_clipped)
    return aggregate(0.5 * err, mask, agg, norm_length=norm_length), {"vf_clipfrac": clipfrac}


def entropy_from_logits(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-token entropy of the softmax over the vocabulary, computed in fp32 (logsumexp form).

    Args:
        logits: (B, T, V) any float dtype.
        mask: optional (B, T); masked positions are 0 in the output.
    Returns:
        (B, T) fp32 entropies.
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    ent = lse - (probs * logits).sum(dim=-1)
    if mask is not None:
        ent = torch.where(_valid(mask, ent), ent, 0.0)
    return ent


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] per position, in fp32 without materialising the full log-softmax twice.

    Args:
        logits: (B, T, V); labels: (B, T) token ids.
    Returns:
        (B, T) fp32 log-probs.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def off_policy_weights(
    old_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
) -> Tensor:
    """Truncated importance weights pi_old / pi_behaviour for rollouts from a stale or different engine (TIS).

    `token`: min(exp(old - behaviour), cap) per token. `sequence`: min(exp(sum_t (old - behaviour)), cap) per row,
    placed on every valid token. The weights are detached; masked positions are 0.

    Args:
        old_logp: (B, T) log-probs under the training engine's copy of the rollout policy.
        behaviour_logp: (B, T) log-probs reported by the inference engine that sampled the tokens.
        mask: (B, T).
    Returns:
        (B, T) weights in [0, cap].
    """
    valid = _valid(mask, old_logp)
    lr = torch.where(valid, old_logp.detach() - behaviour_logp.detach(), 0.0)
    log_cap = math.log(cap)
    if level == "token":
        w = torch.exp(torch.clamp(lr, max=log_cap))
    elif level == "sequence":
        w = torch.exp(torch.clamp(lr.sum(-1), max=log_cap))[:, None].expand_as(lr)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    return torch.where(valid, w, 0.0)


def overlong_penalty(lengths: Tensor, *, max_length: int, buffer: int) -> Tensor:
    """DAPO soft overlong punishment: 0 up to max_length - buffer, then linear down to -1 at max_length.

    Args:
        lengths: (B,) response lengths in tokens.
    Returns:
        (B,) float penalties in [-1, 0].
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"buffer must be in (0, max_length], got buffer={buffer}, max_length={max_length}")
    expected = max_length - buffer
    over = (lengths.float() - expected) / buffer
    return -torch.clamp(over, 0.0, 1.0)
