"""Supervised fine-tuning loss: the negative log-likelihood of target tokens.

Conventions as in `roll_algos.losses`: per-token `(B, T)` log-probs of the target tokens with a 0/1 `mask` (1 = the
token is trained on; prompt, padding and masked context tokens are 0). Masked positions never influence the loss or
its gradient, whatever they hold (NaN and inf included): the log-probs are sanitised with `torch.where` before any
arithmetic. The scalar loss is reduced with `losses.aggregate`, so SFT accepts the same `agg` modes as the RL losses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from roll_algos.losses import _fp32, _valid, aggregate

__all__ = ["sft_loss"]


def sft_loss(
    logprobs: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the target tokens, L_t = -log p(y_t | y_<t, x), aggregated with `agg`.

    With the default `token-mean`: loss = sum_t(-logprobs_t * m_t) / sum_t m_t (0 when no token is valid).

    Args:
        logprobs: (B, T) log-probs of the target tokens under the model (with grad).
        mask: (B, T) 0/1 loss mask.
        agg: one of `losses.AGG_MODES`.
        norm_length: the constant length for `seq-mean-token-sum-norm`.
    Returns:
        (loss, metrics): a 0-dim loss; metrics are detached 0-dim tensors: `nll` (token mean of -logprobs over
        valid tokens, whatever `agg` is), `ppl` (exp of `nll`), `tokens` (the number of valid tokens, as a float);
        fp32 for half-precision log-probs (as the loss).
    Raises:
        ValueError: `mask` and `logprobs` differ in shape, `logprobs` is not (B, T), or `agg` is unknown.
    """
    valid = _valid(mask, logprobs)
    nll = -torch.where(valid, logprobs, 0.0)
    loss = aggregate(nll, valid, agg, norm_length=norm_length)
    with torch.no_grad():
        # In fp32 for half-precision inputs, as `aggregate`: bf16 counted 3001 tokens as 3008 (8 bits of mantissa).
        tokens = valid.sum().to(_fp32(nll).dtype)
        mean_nll = _fp32(nll.detach()).sum() / tokens.clamp_min(1)
        metrics = {"nll": mean_nll, "ppl": torch.exp(mean_nll), "tokens": tokens}
    return loss, metrics
