"""Distillation losses: top-k KL to a teacher (offline / logit distillation) and on-policy distillation advantages.

Conventions as in `roll_algos.losses`: per-token `(B, T)` with a 0/1 `mask`; top-k tensors are `(B, T, K)`. Masked
positions never influence a loss or its gradient, whatever they hold (NaN and inf included): inputs are sanitised
with `torch.where` before any arithmetic. Teacher log-probs are constants (detached here): only the student learns.

Top-k KL. The teacher stores, per position, its K most likely token ids and their log-probs (normalised over the
full vocabulary); the student's log-probs are gathered at the same ids. The two distributions are compared on K + 1
buckets: the K ids and one "tail" bucket holding the remaining mass, tail = 1 - sum_k p_k. With p the first argument
and q the second, KL(p || q) = sum_k p_k (log p_k - log q_k) + p_tail (log p_tail - log q_tail); `forward` is
KL(teacher || student) (mass-covering), `reverse` is KL(student || teacher) (mode-seeking). With K = V the tails are
0 and this is the exact full-vocabulary KL. The bucketed KL is a lower bound of the full KL (merging outcomes never
increases a KL), so it is >= 0 and 0 when the student matches the teacher on the K ids. Without the tail bucket
(`tail=False`) it is the KL between the two distributions conditioned on the K ids: >= 0, but no bound of the full
KL (it can exceed it). An id where p_k = 0 (log-prob -inf) adds 0 (0 log 0 = 0), one where q_k = 0 < p_k adds +inf.

Peers (TRL's GKDTrainer `generalized_jsd_loss`, Agarwal et al. 2024 eq. 1): `forward` is its beta = 0 and `reverse`
its beta = 1 (at K = V), with its conventions: both sides at the same temperature, applied to the logits before the
softmax (the train engines' log_softmax(logits / temperature); offline distillation uses temperature 1), masked
tokens excluded and the loss a mean over the unmasked tokens (`token-mean`, TRL's batchmean over labels != -100).
The generalized JSD of 0 < beta < 1 (beta KL(T || M) + (1 - beta) KL(S || M), M = beta T + (1 - beta) S) is not
offered: it needs the student's full distribution, which a top-k target does not determine.

Numerics: each tail is computed as -expm1(logsumexp_k log p_k) (exact for tails near 0 and near 1), floored at 0 when
rounding makes the top-k mass exceed 1. Inside the logarithms both tails are clamped at `TAIL_EPS` = 1e-6, so
log q_tail is finite when a distribution puts (numerically) all its mass on the K ids; the multiplying p_tail is not
clamped, so a tail of 0 contributes exactly 0 (0 log 0 = 0) and a KL with both tails under 1e-6 has no tail term.
The clamp bounds the tail term of a student whose top-k mass is ~1 while the teacher's is not at
p_tail * (log p_tail - log 1e-6), a large but finite penalty with a finite gradient (none through the clamped tail:
fp32 log-probs cannot resolve a tail below it).

On-policy distillation (Thinking Machines' "On-Policy Distillation"; Agarwal et al.'s GKD with lambda = 1 and
beta = 1, reverse KL): the student samples, the teacher scores the sampled tokens, and each token's advantage is the
negative per-token reverse-KL estimate -(log pi_S(y_t) - log pi_T(y_t)), trained with any policy-gradient loss. At a
fixed context, E_{y ~ pi_S}[A(y) grad log pi_S(y)] = -grad KL(pi_S || pi_T): the policy gradient is an unbiased
one-sample estimate of GKD's per-token reverse-KL gradient (later tokens' terms are not credited to earlier ones).
"""

from __future__ import annotations

import torch
from torch import Tensor

from roll_algos.losses import _valid, aggregate, masked_mean

__all__ = [
    "DISTILL_KL_KINDS",
    "TAIL_EPS",
    "on_policy_distill_advantages",
    "reverse_kl_per_token",
    "topk_distill_loss",
]

DISTILL_KL_KINDS = ("forward", "reverse")
#: Floor of a tail mass inside a logarithm (see the module docstring).
TAIL_EPS = 1e-6


def _log_tail(logp: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(B, T, K) log-probs -> top-k mass (B, T), tail mass >= 0 (B, T), log of the tail clamped at TAIL_EPS (B, T)."""
    log_mass = torch.logsumexp(logp, dim=-1).clamp_max(0.0)
    tail = -torch.expm1(log_mass)
    return torch.exp(log_mass), tail, torch.log(tail.clamp_min(TAIL_EPS))


def _xlogy_kl(p_logp: Tensor, q_logp: Tensor) -> Tensor:
    """sum_k p_k (log p_k - log q_k) with 0 log 0 = 0: an id where p_k = 0 (log-prob -inf) adds 0 whatever q_k,
    with a zero gradient (the -inf is replaced before any arithmetic: 0 * -inf would be NaN, forward and backward).
    An id where q_k = 0 < p_k adds +inf (the KL is infinite)."""
    absent = p_logp == float("-inf")
    p = torch.where(absent, 0.0, p_logp)
    q = torch.where(absent, 0.0, q_logp)
    return torch.where(absent, 0.0, torch.exp(p) * (p - q)).sum(-1)


def _bucket_kl(p_logp: Tensor, q_logp: Tensor, tail: bool) -> Tensor:
    """KL(p || q) over the K ids (+ the tail bucket when `tail`). (B, T, K) x2 -> (B, T)."""
    if not tail:
        # Without a tail bucket both distributions are renormalised on the K ids: a proper KL (>= 0) between the
        # conditionals given "the token is among the teacher's top-k".
        p_logp = p_logp - torch.logsumexp(p_logp, dim=-1, keepdim=True)
        q_logp = q_logp - torch.logsumexp(q_logp, dim=-1, keepdim=True)
    kl = _xlogy_kl(p_logp, q_logp)
    if tail:
        _, p_tail, p_log_tail = _log_tail(p_logp)
        _, _, q_log_tail = _log_tail(q_logp)
        kl = kl + p_tail * (p_log_tail - q_log_tail)
    return kl


def topk_distill_loss(
    student_logp: Tensor,
    teacher_logp: Tensor,
    mask: Tensor,
    *,
    kind: str = "forward",
    tail: bool = True,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """KL between teacher and student on the teacher's top-k token ids plus a tail bucket, aggregated with `agg`.

    forward: KL_t = sum_k pT_k (log pT_k - log pS_k) + pT_tail (log pT_tail - log pS_tail)
    reverse: KL_t = sum_k pS_k (log pS_k - log pT_k) + pS_tail (log pS_tail - log pT_tail)
    with p_tail = 1 - sum_k p_k (tails clamped at `TAIL_EPS` inside the logs; see the module docstring). With
    `tail=False` the tail bucket is dropped and both distributions are renormalised over the K ids first.

    Args:
        student_logp: (B, T, K) student log-probs (normalised over the full vocabulary) at the teacher's top-k ids,
            with grad.
        teacher_logp: (B, T, K) the teacher's top-k log-probs (normalised over the full vocabulary); detached here.
        mask: (B, T) 0/1.
        kind: `forward` (KL(teacher || student)) or `reverse` (KL(student || teacher)).
        tail: keep the tail bucket (True) or renormalise over the K ids (False).
        agg: one of `losses.AGG_MODES`; norm_length: for `seq-mean-token-sum-norm`.
    Returns:
        (loss, kl, metrics): the 0-dim aggregated loss, the (B, T) per-token KL (0 at masked positions), and
        detached 0-dim metrics `kl` (token mean), `teacher_topk_mass`, `student_topk_mass` (token means of the
        probability mass on the K ids).
    Raises:
        ValueError: unknown `kind` or `agg`, shapes that are not (B, T, K) x2 and (B, T), or K = 1 with
            `tail=False` (a loss of 0 whatever the student).
    """
    if kind not in DISTILL_KL_KINDS:
        raise ValueError(f"unknown distillation KL kind {kind!r}; choose one of {', '.join(DISTILL_KL_KINDS)}")
    if student_logp.dim() != 3 or teacher_logp.shape != student_logp.shape or student_logp.shape[-1] == 0:
        raise ValueError(
            f"student_logp {tuple(student_logp.shape)} and teacher_logp {tuple(teacher_logp.shape)} must both be "
            "(B, T, K) with K >= 1"
        )
    if student_logp.shape[-1] == 1 and not tail:
        # Renormalised over one id both sides are log 1: the loss and its gradient are 0 whatever the student
        # (distill.topk=1 is refused with tail=false, but rows storing their own top-1 got here and trained nothing).
        raise ValueError(
            "K=1 top-k lists with tail=False give a KL of 0 whatever the student (both sides renormalised over one "
            "id): keep the tail bucket (distill.tail=true) or give the teacher's top-k with K >= 2"
        )
    valid = _valid(mask, student_logp[..., 0])
    keep = valid[..., None]
    # Upcast: tails are differences of masses close to 1, which half precision cannot resolve.
    dtype = torch.promote_types(student_logp.dtype, torch.float32)
    student = torch.where(keep, student_logp.to(dtype), 0.0)
    teacher = torch.where(keep, teacher_logp.detach().to(dtype), 0.0)
    kl = _bucket_kl(teacher, student, tail) if kind == "forward" else _bucket_kl(student, teacher, tail)
    kl = torch.where(valid, kl, 0.0)
    loss = aggregate(kl, valid, agg, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "kl": masked_mean(kl.detach(), valid),
            "teacher_topk_mass": masked_mean(_log_tail(teacher)[0], valid),
            "student_topk_mass": masked_mean(_log_tail(student.detach())[0], valid),
        }
    return loss, kl, metrics


def reverse_kl_per_token(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token reverse-KL estimate on sampled tokens, log pi_S(y_t) - log pi_T(y_t) (the k1 estimator of
    KL(student || teacher) when y_t is sampled from the student); 0 at masked positions, detached.

    Args:
        student_logp, teacher_logp: (B, T) log-probs of the sampled tokens; mask: (B, T) 0/1.
    Returns:
        (B, T) estimates; their masked mean is the usual `reverse_kl` metric of on-policy distillation.
    """
    valid = _valid(mask, student_logp)
    if teacher_logp.shape != student_logp.shape:
        raise ValueError(f"teacher_logp {tuple(teacher_logp.shape)} must be {tuple(student_logp.shape)}")
    s = torch.where(valid, student_logp.detach(), 0.0)
    t = torch.where(valid, teacher_logp.detach(), 0.0)
    return s - t


def on_policy_distill_advantages(
    student_logp: Tensor, teacher_logp: Tensor, mask: Tensor, *, coef: float = 1.0
) -> Tensor:
    """Per-token advantages of on-policy distillation: A_t = -coef * (log pi_S(y_t) - log pi_T(y_t)).

    Tokens the teacher finds likelier than the student get A > 0 (reinforced), tokens the student overrates get
    A < 0; the expected sum of -A / coef over the student's samples is the sequence reverse KL, so a
    policy-gradient step on these advantages lowers KL(student || teacher).

    Args:
        student_logp: (B, T) the student's (sampling policy's) log-probs of its sampled tokens.
        teacher_logp: (B, T) the teacher's log-probs of the same tokens.
        mask: (B, T) 0/1.
        coef: the scale of the advantage (> 0).
    Returns:
        (B, T) detached advantages, 0 at masked positions.
    """
    if not coef > 0:
        raise ValueError(f"coef must be > 0, got {coef}")
    return -coef * reverse_kl_per_token(student_logp, teacher_logp, mask)
