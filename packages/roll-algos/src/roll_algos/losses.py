"""Policy and value losses, loss aggregation, entropy, off-policy weights and the DAPO overlong penalty.

Conventions as in `roll_algos.advantages`: per-token `(B, T)` with a 0/1 `mask`, sequence-level `(B,)`.
Masked positions never influence a loss or its gradient, whatever they hold (NaN and inf included): inputs are
sanitised with `torch.where` before any arithmetic, so no NaN reaches the backward pass either. Half-precision
inputs (bf16, fp16) are computed in fp32 (ratios, sums, metrics; the gradient still reaches the half-precision
tensor); fp32 and fp64 inputs keep their dtype.

Aggregation modes (`aggregate`), with m the mask and L the per-token loss:
- `token-mean`: sum(L*m) / sum(m)  (0 when no token is valid)
- `seq-mean-token-mean`: mean over sequences with >= 1 valid token of (sum_t L*m / sum_t m)
- `seq-mean-token-sum`: mean over all B sequences of sum_t L*m (rows without a valid token count, as the engines'
  row units do; verl's agg_loss leaves them out of the mean)
- `seq-mean-token-sum-norm` (Dr.GRPO): sum(L*m) / (B * norm_length) (the paper's 1/G; verl's agg_loss omits the 1/B)

Policy losses are a plugin kind. Each variant is one function of the `PolicyLoss` protocol (sanitised tensors and
`PolicyLossSettings` in, per-token loss, ratio and metrics out) declared by name under the entry-point group
`roll.losses`: roll-algos declares its own (`ppo_loss` as `ppo`, ...) in its pyproject.toml exactly as a plugin
package declares its. `policy_loss(variant=name)` is the one dispatcher: it looks the name up among the installed
entry points (`get_policy_loss`, cached per process), sanitises and checks the inputs, calls the variant, and
aggregates and reports the shared metrics, so a built-in and an out-of-tree loss take the same path and get the
same masking, aggregation and metrics. Callers hold the name, never the function: a name pickles to a Ray worker
and is resolved there. `POLICY_LOSS_VARIANTS` is the installed names (read from the entry points on first use), so
the names `algo.policy_loss` accepts are defined once, in the pyproject.toml that declares them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from roll_algos import _plugins
from roll_algos._plugins import PolicyLossPluginError

__all__ = [
    "AGG_MODES",
    "NO_CLIP_RANGE",
    "NO_DUAL_CLIP",
    "NO_RATIO_CAP",
    "POLICY_LOSS_VARIANTS",
    "PolicyLoss",
    "PolicyLossPluginError",
    "PolicyLossSettings",
    "PolicyLossTerms",
    "aggregate",
    "bounded_log_ratio",
    "cispo_loss",
    "clear_policy_loss_cache",
    "entropy_from_logits",
    "get_policy_loss",
    "gspo_loss",
    "masked_mean",
    "off_policy_weights",
    "overlong_penalty",
    "policy_loss",
    "policy_loss_names",
    "ppo_loss",
    "tis_loss",
    "token_logprobs",
    "topr_loss",
    "value_loss",
    "vanilla_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: roll-algos' own variants that never read `dual_clip`: a stop-gradient weight times A logp, no clipped surrogate
#: to bound (the config refuses a dual clip with them: it would be silently ignored).
NO_DUAL_CLIP = ("cispo", "tis", "topr", "vanilla")
#: roll-algos' own variants that never read `clip_low` / `clip_high` (tis caps its weight with `ratio_cap`, topr
#: clips at [0, 1], vanilla has no weight); the config refuses a non-default clip range with them.
NO_CLIP_RANGE = ("tis", "topr", "vanilla")
#: roll-algos' own variants that never read `ratio_cap` (every one but tis); the config refuses a non-default cap.
NO_RATIO_CAP = ("ppo", "gspo", "cispo", "topr", "vanilla")
#: The installed policy-loss names (`policy_loss_names()`), computed on first access by the module `__getattr__`
#: below: reading entry-point metadata costs ~50 ms, which importing this module must not.
POLICY_LOSS_VARIANTS: tuple[str, ...]
# Bound on |log ratio| before exp: beyond this the ratio is clipped anyway, and exp would overflow in fp32.
_MAX_LOG_RATIO = 20.0


def _fp32(x: Tensor) -> Tensor:
    """x in fp32 if it is a half-precision float (bf16: ratios in steps of 2^-7 near 1, and half-precision sums),
    else x unchanged (fp64 stays fp64). Differentiable: the gradient is cast back to x's dtype."""
    return x.float() if x.is_floating_point() and x.dtype in (torch.bfloat16, torch.float16) else x


def _valid(mask: Tensor, like: Tensor) -> Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match tensor {tuple(like.shape)}")
    return mask.bool()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over valid entries (0 when none); masked values never contribute. Returns a 0-dim tensor."""
    valid = _valid(mask, x)
    return torch.where(valid, _fp32(x), 0.0).sum() / valid.sum().clamp_min(1)


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
    lm = torch.where(valid, _fp32(loss), 0.0)
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


def bounded_log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    """log r = logp - old_logp, clamped to +-20 so that exp(log r) stays finite in fp32. (B, T) -> (B, T)."""
    return torch.clamp(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


# ---------------------------------------------------------------- the policy-loss plugin contract
@dataclass(frozen=True)
class PolicyLossSettings:
    """The settings every policy loss receives; a variant reads those it uses and ignores the rest."""

    #: PPO clip range below 1: ratios under 1 - clip_low are clipped (and cispo's weight floor).
    clip_low: float = 0.2
    #: PPO clip range above 1 (clip_high > clip_low is DAPO clip-higher; cispo's weight ceiling).
    clip_high: float = 0.2
    #: Dual clip c > 1: bounds the loss of negative-advantage tokens at c|A| (None: off).
    dual_clip: float | None = None
    #: Truncation of the importance ratio (tis).
    ratio_cap: float = 2.0
    #: (B,) bool, rows with positive reward (topr); None: rows whose masked mean advantage is > 0.
    positive: Tensor | None = None


class PolicyLossTerms(NamedTuple):
    """What a policy loss returns; `policy_loss` aggregates `loss` and reports `ratio`'s masked mean and max."""

    #: (B, T) per-token loss; only valid positions are read.
    loss: Tensor
    #: (B, T) the importance ratio the loss used (per token, or a row's sequence ratio on each of its tokens).
    ratio: Tensor
    #: Variant-specific detached 0-dim metrics (e.g. `clipfrac_low`); the dispatcher reports 0 for the three
    #: clip fractions a variant leaves out, so every variant logs the same keys.
    metrics: dict[str, Tensor]


class PolicyLoss(Protocol):
    """One policy-loss variant: the per-token loss of sanitised inputs.

    May assume: `logp`, `old_logp`, `advantages` are (B, T) and hold 0 (never NaN) at masked positions; `old_logp`
    and `advantages` are detached; `mask` is a (B, T) bool tensor. Must not: aggregate (the dispatcher does, with
    `agg`), or let a masked position reach the loss's gradient. Register it under `[project.entry-points.
    "roll.losses"]` as `<name> = "module:function"`; `policy_loss(variant=<name>)` and `algo.policy_loss=<name>`
    then select it. `roll_algos.testing.PolicyLossTestSuite` with `variants = ("<name>",)` checks the contract.
    """

    def __call__(
        self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, settings: PolicyLossSettings
    ) -> PolicyLossTerms: ...


def _clipped_surrogate(ratio: Tensor, adv: Tensor, mask: Tensor, s: PolicyLossSettings) -> PolicyLossTerms:
    """max(-A r, -A clip(r, 1-clip_low, 1+clip_high)), with the dual clip for A < 0 when set."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - s.clip_low, 1.0 + s.clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "clipfrac_low": masked_mean(((ratio < 1.0 - s.clip_low) & (adv < 0)).to(ratio.dtype), mask),
        "clipfrac_high": masked_mean(((ratio > 1.0 + s.clip_high) & (adv > 0)).to(ratio.dtype), mask),
    }
    if s.dual_clip is not None:
        if s.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {s.dual_clip}")
        bound = -adv * s.dual_clip  # positive where adv < 0
        dual_active = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        metrics["clipfrac_dual"] = masked_mean(dual_active.to(ratio.dtype), mask)
    return PolicyLossTerms(loss, ratio, {k: v.detach() for k, v in metrics.items()})


def ppo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, settings: PolicyLossSettings
) -> PolicyLossTerms:
    """`ppo`: max(-A r, -A clip(r, 1-clip_low, 1+clip_high)), r = exp(logp - old_logp); dual clip when set."""
    ratio = torch.exp(bounded_log_ratio(logp, old_logp))
    return _clipped_surrogate(ratio, advantages, mask, settings)


def gspo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, settings: PolicyLossSettings
) -> PolicyLossTerms:
    """`gspo` (GSPO-token, arXiv 2507.18071 eq. 13): as `ppo` with s_i,t = sg(s_i) * pi_t / sg(pi_t) in place of r_t,
    s_i = exp(masked mean_t log r_t) the row's sequence ratio.

    s_i,t equals s_i in value (the loss and the clipping are the sequence's), and its gradient is s_i * grad log pi_t:
    token t is weighted by its own advantage A_t. With one advantage per row this is GSPO exactly (the paper shows
    the two coincide); with per-token advantages (GAE, token-level correction weights, AsyPPO's or attention
    credit's masks) a token whose advantage is 0 gets no gradient, where a gradient through the row mean would give
    every token the row's mean advantage.

    log s_i is the mean of the true token log ratios, bounded to +-20 only after averaging (exp stays finite):
    clamping each token first let extreme tokens offset (log r of 25 and -21 read as s = 1, not e^2)."""
    seq_log_ratio = torch.clamp(_seq_mean(logp - old_logp, mask), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    seq_log_ratio = seq_log_ratio.detach()[:, None]
    ratio = torch.exp(seq_log_ratio + (logp - logp.detach()))
    return _clipped_surrogate(ratio, advantages, mask, settings)


def _weighted(logp: Tensor, advantages: Tensor, ratio: Tensor, weight: Tensor) -> PolicyLossTerms:
    """-sg(weight) A logp: the REINFORCE family, weighted by a stop-gradient function of the ratio."""
    return PolicyLossTerms(-weight.detach() * advantages * logp, ratio, {})


def cispo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, settings: PolicyLossSettings
) -> PolicyLossTerms:
    """`cispo`: -sg(clip(r, 1-clip_low, 1+clip_high)) A logp.

    The weight floor 1-clip_low is verl's; the CISPO paper (MiniMax-M1, arXiv 2506.13585) sets no lower bound
    (its eps_low is large); a clip_low near 1 (roll's config keeps it < 1) comes closest to the paper's weight."""
    ratio = torch.exp(bounded_log_ratio(logp, old_logp))
    weight = torch.clamp(ratio, 1.0 - settings.clip_low, 1.0 + settings.clip_high)
    return _weighted(logp, advantages, ratio, weight)


def tis_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, settings: PolicyLossSettings
) -> PolicyLossTerms:
    """`tis`: -sg(min(r, ratio_cap)) A logp (truncated importance sampling)."""
    ratio = torch.exp(bounded_log_ratio(logp, old_logp))
    return _weighted(logp, advantages, ratio, torch.clamp(ratio, 0.0, settings.ratio_cap))


def topr_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, settings: PolicyLossSettings
) -> PolicyLossTerms:
    """`topr`: rows with positive reward: -A logp; others: -sg(clip(r, 0, 1)) A logp."""
    ratio = torch.exp(bounded_log_ratio(logp, old_logp))
    positive = settings.positive if settings.positive is not None else _seq_mean(advantages, mask) > 0
    weight = torch.where(positive[:, None], torch.ones_like(ratio), torch.clamp(ratio, 0.0, 1.0))
    return _weighted(logp, advantages, ratio, weight)


def vanilla_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, settings: PolicyLossSettings
) -> PolicyLossTerms:
    """`vanilla`: -A logp (REINFORCE; the ratio is reported, not used)."""
    ratio = torch.exp(bounded_log_ratio(logp, old_logp))
    return _weighted(logp, advantages, ratio, torch.ones_like(ratio))


def policy_loss_names() -> tuple[str, ...]:
    """Every installed policy-loss name (`roll.losses` entry points): roll-algos' own, then plugins', each sorted."""
    return _plugins.names()


def get_policy_loss(name: str) -> PolicyLoss:
    """The `PolicyLoss` installed as `name` (imported on first use, then cached per process).

    Raises:
        ValueError: no installed distribution declares `name`; the message lists the installed names.
        PolicyLossPluginError: the entry point fails to import, is not callable, or two distributions declare it.
    """
    installed = policy_loss_names()
    if name not in installed:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {', '.join(installed)}")
    return _plugins.load(name)  # type: ignore[return-value]


def clear_policy_loss_cache() -> None:
    """Forget the installed names and loaded losses (a test that installs a loss plugin at run time)."""
    _plugins.clear_cache()


def __getattr__(name: str) -> tuple[str, ...]:
    # PEP 562: `POLICY_LOSS_VARIANTS` is read from entry-point metadata on first access, not at import.
    if name == "POLICY_LOSS_VARIANTS":
        return _plugins.declared().own
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    """Policy-gradient loss of the PPO family: the installed variant `variant`, aggregated with `agg`.

    roll-algos' variants (r = exp(logp - old_logp), A the advantage, sg = stop-gradient), one `PolicyLoss` each:
    - `ppo` (`ppo_loss`): max(-A r, -A clip(r, 1-clip_low, 1+clip_high)); clip_high > clip_low is DAPO
      clip-higher; `dual_clip=c` (c > 1) bounds the loss of negative-advantage tokens at c|A|.
    - `gspo` (`gspo_loss`): like `ppo` but with the sequence ratio s = exp(masked mean of log r) of the row, in
      GSPO-token form: value s, gradient s * grad logp per token, so each token carries its own advantage.
    - `cispo` (`cispo_loss`): -sg(clip(r, 1-clip_low, 1+clip_high)) A logp.
    - `tis` (`tis_loss`): -sg(min(r, ratio_cap)) A logp (truncated importance sampling).
    - `topr` (`topr_loss`): rows with positive reward: -A logp; others: -sg(clip(r, 0, 1)) A logp.
    - `vanilla` (`vanilla_loss`): -A logp.
    Any other name installed under the `roll.losses` entry-point group is called the same way.

    Args:
        logp: (B, T) log-probs of the sampled tokens under the current policy (with grad).
        old_logp: (B, T) log-probs under the policy that produced the rollout (no grad needed).
        advantages: (B, T) per-token, or (B,) per sequence (broadcast to the valid tokens).
        mask: (B, T) 0/1.
        variant: an installed policy-loss name (`policy_loss_names()`).
        positive: (B,) bool, rows with positive reward for `topr`; default: masked mean advantage > 0.
    Returns:
        (loss, metrics): a 0-dim loss aggregated with `agg`; metrics are detached 0-dim tensors:
        `clipfrac_low`, `clipfrac_high`, `clipfrac_dual` (0 where the variant does not clip), the variant's own,
        `approx_kl` (k3 estimate of KL(old || new) from the old policy's samples: r - 1 - log r, r = exp(logp -
        old_logp), masked mean), `ratio_mean`, `ratio_max`. Half-precision inputs give an fp32 loss and metrics.
    Raises:
        ValueError: unknown `variant` or `agg` (the message lists the choices), or mismatched shapes.
    """
    valid = _valid(mask, logp)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    if old_logp.shape != logp.shape or advantages.shape != logp.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and advantages "
            f"{tuple(advantages.shape)} must all be (B, T)"
        )
    loss_fn = get_policy_loss(variant)
    logp = torch.where(valid, _fp32(logp), 0.0)
    old_logp = torch.where(valid, _fp32(old_logp.detach()), 0.0)
    adv = torch.where(valid, _fp32(advantages.detach()), 0.0)
    settings = PolicyLossSettings(clip_low, clip_high, dual_clip, ratio_cap, positive)
    terms = loss_fn(logp, old_logp, adv, valid, settings)
    if terms.loss.shape != logp.shape or terms.ratio.shape != logp.shape:
        raise ValueError(
            f"policy loss {variant!r} returned loss {tuple(terms.loss.shape)} and ratio {tuple(terms.ratio.shape)}; "
            f"both must be (B, T) = {tuple(logp.shape)}"
        )
    total = aggregate(terms.loss, mask, agg, norm_length=norm_length)
    zeros = torch.zeros((), dtype=logp.dtype, device=logp.device)
    metrics = {"clipfrac_low": zeros, "clipfrac_high": zeros, "clipfrac_dual": zeros}
    metrics.update({k: v.detach() for k, v in terms.metrics.items()})
    with torch.no_grad():
        log_ratio = bounded_log_ratio(logp, old_logp)
        ratio_valid = torch.where(valid, terms.ratio, 0.0)
        # The tokens were sampled from the old policy: k3 of KL(old || new) is r - 1 - log r with r = new / old
        # (Schulman's k3 with the sampler in the denominator); 1/r - 1 + log r estimates neither direction here.
        metrics["approx_kl"] = masked_mean(torch.expm1(log_ratio) - log_ratio, mask)
        metrics["ratio_mean"] = masked_mean(terms.ratio.detach(), mask)
        metrics["ratio_max"] = ratio_valid.max() if valid.any() else zeros
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
    v = torch.where(valid, _fp32(values), 0.0)
    r = torch.where(valid, _fp32(returns.detach()), 0.0)
    err = (v - r).square()
    clipfrac = torch.zeros((), dtype=v.dtype, device=values.device)
    if clip is not None:
        old = torch.where(valid, _fp32(old_values.detach()), 0.0)
        v_clipped = old + torch.clamp(v - old, -clip, clip)
        err_clipped = (v_clipped - r).square()
        clipfrac = masked_mean((err_clipped > err).to(v.dtype), mask).detach()
        err = torch.maximum(err, err_clipped)
    return aggregate(0.5 * err, mask, agg, norm_length=norm_length), {"vf_clipfrac": clipfrac}


def entropy_from_logits(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-token entropy of the softmax over the vocabulary, computed in fp32 (logsumexp form).

    A logit of -inf (a token masked out: a padded vocabulary's extra rows, a truncated or constrained distribution)
    has probability 0 and adds 0 (0 log 0 = 0), to the value and the gradient; the product p * x there was
    0 * -inf = NaN.

    Args:
        logits: (B, T, V) any float dtype.
        mask: optional (B, T); masked positions are 0 in the output.
    Returns:
        (B, T) fp32 entropies.
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    # -inf logits read as 0 in the product (their probability is 0): no NaN, nor a NaN gradient through it. Only
    # when there are any: the filled copy (B, T, V) is kept for the backward, +50 % of the entropy's memory.
    neg_inf = torch.isneginf(logits)
    finite = logits.masked_fill(neg_inf, 0.0) if bool(neg_inf.any()) else logits
    del neg_inf
    ent = lse - (probs * finite).sum(dim=-1)
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
    placed on every valid token. The weights are detached (fp32 for half-precision inputs); masked positions are 0,
    and so is a token (`sequence`: a row) whose ratio is undefined: both log-probs -inf, or at sequence level tokens
    of ratio 0 and of ratio inf in one row.

    Args:
        old_logp: (B, T) log-probs under the training engine's copy of the rollout policy.
        behaviour_logp: (B, T) log-probs reported by the inference engine that sampled the tokens.
        mask: (B, T).
    Returns:
        (B, T) weights in [0, cap].
    """
    valid = _valid(mask, old_logp)
    lr = torch.where(valid, _fp32(old_logp.detach()) - _fp32(behaviour_logp.detach()), 0.0)
    log_cap = math.log(cap)
    if level == "token":
        log_w = lr
    elif level == "sequence":
        # Summed as they are: torch.nan_to_num before the sum also turned +-inf into +-3.4e38, so a row with one
        # token the engine gave probability 0 (+inf) and one the trainer did (-inf) summed to 0 and got weight 1.
        log_w = lr.sum(-1, keepdim=True).expand_as(lr)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    w = torch.exp(torch.clamp(log_w, max=log_cap))
    # A token both policies give probability 0 (-inf - -inf) has no ratio, nor has a row holding one, or holding
    # tokens of ratio 0 and of ratio inf (-inf + inf): weight 0, where NaN would have poisoned the loss.
    return torch.where(valid, torch.nan_to_num(w, nan=0.0), 0.0)


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
