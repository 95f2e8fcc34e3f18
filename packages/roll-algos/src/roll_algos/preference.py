"""Sequence-level preference losses (DPO and relatives) on summed response log-probs, and their row weights.

Inputs are per pair (N,): the policy's summed log-prob of the chosen and the rejected response (sum over the
response's loss-masked tokens), the reference model's the same, and, for the length-normalised variants, each
response's token count. Variants, as TRL's DPOTrainer defines them (simpo: its CPOTrainer; beta > 0; sigma the
logistic function; eps the label smoothing; for a response y, pi(y) its summed policy log-prob, ref(y) the
reference's, |y| its token count):

- `sigmoid` (DPO; reference): h = (pi(yc) - ref(yc)) - (pi(yr) - ref(yr));
  loss = -(1-eps) log sigma(beta h) - eps log sigma(-beta h).
- `ipo` (reference): h = (pi(yc) - ref(yc)) / |yc| - (pi(yr) - ref(yr)) / |yr|  (length-averaged, as TRL);
  loss = (h - 1/(2 beta))^2.
- `hinge` (SLiC; reference): h as `sigmoid`; loss = max(0, 1 - beta h).
- `simpo` (no reference): h = pi(yc)/|yc| - pi(yr)/|yr|; with z = beta h - gamma,
  loss = -(1-eps) log sigma(z) - eps log sigma(-z)  (TRL's CPO trainer with loss_type=simpo and cpo_alpha=0, the
  SimPO paper's setting; CPOTrainer's default cpo_alpha=1 adds the chosen tokens' mean NLL, which the dpo
  objective adds with its sft_weight).

Label smoothing with eps > 0 is conservative DPO (cDPO), as TRL <= 0.28's `sigmoid` with label_smoothing; TRL >=
0.29's `sigmoid` ignores label_smoothing (it reads it for its `robust` and `exo_pair` only), so compare with those
at eps = 0. TRL's `robust` (Robust DPO's unbiased loss, ((1-eps) (-log sigma(beta h)) + eps log sigma(-beta h)) /
(1 - 2 eps)) is a different loss and is not offered. Label smoothing applies to the two logistic variants only, and
`simpo_gamma` to `simpo` only: passing either to another variant is an error rather than a silently ignored setting.
A reference variant refuses a missing reference and `simpo` refuses a given one.

The implicit rewards reported are the quantities the loss compares: beta * (pi - ref) for `sigmoid` and `hinge`,
the length-averaged beta * (pi - ref) / |y| for `ipo`, and beta * pi / |y| for `simpo` (without the gamma margin,
as CPOTrainer). For `ipo` these are TRL <= 0.28's rewards (it averaged both models' log-probs first); TRL >= 0.29
reports beta * (pi - ref) of the summed log-probs for `ipo` as well, so its rewards, margins and accuracies differ
from roll's there (the loss does not). The accuracy is the fraction of pairs with chosen reward > rejected reward,
as TRL's rewards/accuracies.

`preference_row_weights` turns any variant into per-sequence weights for a surrogate with detached weights, so a
trainer can apply the exact preference gradient through an engine that only knows per-token losses (see there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PREFERENCE_VARIANTS", "REFERENCE_FREE_VARIANTS", "preference_loss", "preference_row_weights"]

PREFERENCE_VARIANTS = ("sigmoid", "ipo", "hinge", "simpo")
#: Variants that take no reference model (a reference passed to them is an error).
REFERENCE_FREE_VARIANTS = ("simpo",)
_LENGTH_NORMALISED = ("ipo", "simpo")
_SMOOTHED = ("sigmoid", "simpo")


def _check(
    chosen_logp: Tensor,
    rejected_logp: Tensor,
    ref_chosen: Tensor | None,
    ref_rejected: Tensor | None,
    variant: str,
    beta: float,
    label_smoothing: float,
    simpo_gamma: float,
    chosen_len: Tensor | None,
    rejected_len: Tensor | None,
) -> None:
    """Every configuration and shape error `preference_loss` can meet, each with a message naming the fix."""
    if variant not in PREFERENCE_VARIANTS:
        raise ValueError(f"unknown preference loss {variant!r}; choose one of {', '.join(PREFERENCE_VARIANTS)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and variant not in _SMOOTHED:
        raise ValueError(f"label_smoothing applies to {' and '.join(_SMOOTHED)} only, not {variant!r}")
    if simpo_gamma and variant != "simpo":
        raise ValueError(f"simpo_gamma applies to 'simpo' only, not {variant!r}")
    if chosen_logp.dim() != 1 or rejected_logp.shape != chosen_logp.shape or chosen_logp.numel() == 0:
        raise ValueError(
            f"chosen_logp {tuple(chosen_logp.shape)} and rejected_logp {tuple(rejected_logp.shape)} must both be "
            "(N,) with N >= 1"
        )
    has_ref = (ref_chosen is not None, ref_rejected is not None)
    if variant in REFERENCE_FREE_VARIANTS:
        if any(has_ref):
            raise ValueError(f"{variant!r} is reference-free: pass ref_chosen=None and ref_rejected=None")
    else:
        if not all(has_ref):
            raise ValueError(f"{variant!r} needs the reference log-probs: pass both ref_chosen and ref_rejected")
        for name, ref in (("ref_chosen", ref_chosen), ("ref_rejected", ref_rejected)):
            if ref.shape != chosen_logp.shape:  # type: ignore[union-attr]
                raise ValueError(f"{name} {tuple(ref.shape)} must be (N,) = {tuple(chosen_logp.shape)}")  # type: ignore[union-attr]
    if variant in _LENGTH_NORMALISED:
        for name, length in (("chosen_len", chosen_len), ("rejected_len", rejected_len)):
            if length is None:
                raise ValueError(f"{variant!r} normalises by response length: pass chosen_len and rejected_len")
            if length.shape != chosen_logp.shape:
                raise ValueError(f"{name} {tuple(length.shape)} must be (N,) = {tuple(chosen_logp.shape)}")
            if bool((length <= 0).any()):
                raise ValueError(f"{name} holds a response of length <= 0; every response needs >= 1 token")


def preference_loss(
    chosen_logp: Tensor,
    rejected_logp: Tensor,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    *,
    variant: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.0,
    chosen_len: Tensor | None = None,
    rejected_len: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair preference loss of `variant` (see the module docstring for each formula).

    Args:
        chosen_logp, rejected_logp: (N,) summed policy log-probs of the chosen / rejected responses (with grad).
        ref_chosen, ref_rejected: (N,) the reference model's summed log-probs (detached here); None for `simpo`.
        variant: one of `PREFERENCE_VARIANTS`.
        beta: the inverse temperature of the implicit reward (> 0).
        label_smoothing: eps in [0, 0.5), the assumed label-flip probability (cDPO); `sigmoid` and `simpo` only.
        simpo_gamma: SimPO's target reward margin gamma; `simpo` only.
        chosen_len, rejected_len: (N,) response token counts (>= 1); required by `ipo` and `simpo`.
    Returns:
        (loss, metrics): the (N,) per-pair loss (the caller reduces it, usually with a mean); metrics are detached
        0-dim tensors: `rewards_chosen`, `rewards_rejected` (mean implicit rewards), `reward_margin` (their mean
        difference), `reward_accuracy` (fraction of pairs whose implicit reward margin is > 0), `loss` (the mean).
    Raises:
        ValueError: an unknown variant, beta <= 0, a setting the variant does not use, a missing or unexpected
            reference, missing or non-positive lengths, or mismatched shapes.
    """
    _check(
        chosen_logp,
        rejected_logp,
        ref_chosen,
        ref_rejected,
        variant,
        beta,
        label_smoothing,
        simpo_gamma,
        chosen_len,
        rejected_len,
    )
    chosen, rejected = chosen_logp, rejected_logp
    if ref_chosen is not None and ref_rejected is not None:
        chosen = chosen - ref_chosen.detach()
        rejected = rejected - ref_rejected.detach()
    if variant in _LENGTH_NORMALISED:
        chosen = chosen / chosen_len.to(chosen.dtype)  # type: ignore[union-attr]
        rejected = rejected / rejected_len.to(rejected.dtype)  # type: ignore[union-attr]
    # `chosen` / `rejected` are now the per-response implicit rewards divided by beta.
    h = chosen - rejected
    if variant == "sigmoid" or variant == "simpo":
        logits = beta * h - (simpo_gamma if variant == "simpo" else 0.0)
        loss = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    elif variant == "ipo":
        loss = (h - 1.0 / (2.0 * beta)).square()
    else:  # hinge
        loss = torch.relu(1.0 - beta * h)
    with torch.no_grad():
        r_chosen, r_rejected = beta * chosen.detach(), beta * rejected.detach()
        margin = r_chosen - r_rejected
        metrics = {
            "rewards_chosen": r_chosen.mean(),
            "rewards_rejected": r_rejected.mean(),
            "reward_margin": margin.mean(),
            "reward_accuracy": (margin > 0).to(margin.dtype).mean(),
            "loss": loss.detach().mean(),
        }
    return loss, metrics


def preference_row_weights(
    chosen_logp: Tensor,
    rejected_logp: Tensor,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    *,
    variant: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.0,
    chosen_len: Tensor | None = None,
    rejected_len: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """Per-sequence weights w = d mean_i(loss_i) / d logp for a surrogate with detached weights.

    With L(theta) = (1/N) sum_i loss_i(c_i(theta), r_i(theta)) (c_i, r_i the summed log-probs of pair i's chosen
    and rejected responses), the chain rule gives grad L = sum_i w_c,i grad c_i + w_r,i grad r_i with
    w_c,i = dL/dc_i and w_r,i = dL/dr_i evaluated at the current theta. So the surrogate
        S(theta) = sum_i sg(w_c,i) c_i(theta) + sg(w_r,i) r_i(theta)
    (sg = stop-gradient) has grad S = grad L at that theta: a trainer computes these weights from log-probs it
    already has, then minimises S as a per-token loss (w of a row times each of its token log-probs, SUMMED over
    tokens, rows and micro-batches, never averaged) through any engine, and gets the exact preference gradient.
    The identity holds at the theta the weights were computed at, i.e. for one optimizer step per weight
    computation. Length normalisation (`ipo`, `simpo`) is inside w (a factor 1/|y|), so S takes summed log-probs.

    Args and metrics: as `preference_loss`. The inputs are only read (detached copies are differentiated).
    Returns:
        (w_chosen (N,), w_rejected (N,), loss (N,) detached per-pair loss, metrics).
    """
    chosen = chosen_logp.detach().clone().requires_grad_(True)
    rejected = rejected_logp.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss, metrics = preference_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            variant=variant,
            beta=beta,
            label_smoothing=label_smoothing,
            simpo_gamma=simpo_gamma,
            chosen_len=chosen_len,
            rejected_len=rejected_len,
        )
        w_chosen, w_rejected = torch.autograd.grad(loss.mean(), (chosen, rejected))
    return w_chosen, w_rejected, loss.detach(), metrics
