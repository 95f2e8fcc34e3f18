"""Advantage estimators as the pipeline uses them, registered under the `roll.algorithms` entry-point group.

Each estimator maps (sequence scores, token rewards, mask, values, algo config) to per-token advantages and, for
value-based estimators, returns. Sequence scores are outcome rewards (B,); token rewards are (B, R) with the
outcome on the last valid token minus any KL penalty (when `algo.kl_in_reward`). Out-of-tree estimators register
a function with this signature under `roll.algorithms` and are selected by `algo.adv_estimator=<name>`.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from roll_algos import advantages as A


class AdvantageEstimator(Protocol):
    def __call__(
        self, scores: Tensor, token_rewards: Tensor, mask: Tensor, values: Tensor | None, algo: Any
    ) -> tuple[Tensor, Tensor | None]: ...


def grpo(
    scores: Tensor, token_rewards: Tensor, mask: Tensor, values: Tensor | None, algo: Any
) -> tuple[Tensor, Tensor | None]:
    """(r - group mean) / group std on every token."""
    return A.broadcast_to_tokens(A.group_normalized(scores, algo.group_size), mask), None


def dr_grpo(
    scores: Tensor, token_rewards: Tensor, mask: Tensor, values: Tensor | None, algo: Any
) -> tuple[Tensor, Tensor | None]:
    """r - group mean on every token (no std normalisation)."""
    return A.broadcast_to_tokens(A.group_normalized(scores, algo.group_size, std_normalize=False), mask), None


def rloo(
    scores: Tensor, token_rewards: Tensor, mask: Tensor, values: Tensor | None, algo: Any
) -> tuple[Tensor, Tensor | None]:
    """Leave-one-out baseline on every token."""
    return A.broadcast_to_tokens(A.leave_one_out(scores, algo.group_size), mask), None


def reinforce_pp(
    scores: Tensor, token_rewards: Tensor, mask: Tensor, values: Tensor | None, algo: Any
) -> tuple[Tensor, Tensor | None]:
    """Discounted return of the token rewards, whitened over the batch."""
    returns = A.discounted_returns(token_rewards, mask, gamma=algo.gamma)
    return A.whiten(returns, mask), None


def reinforce_pp_baseline(
    scores: Tensor, token_rewards: Tensor, mask: Tensor, values: Tensor | None, algo: Any
) -> tuple[Tensor, Tensor | None]:
    """Subtract each group's mean outcome from the token rewards, then as reinforce_pp."""
    baseline = scores - A.group_normalized(scores, algo.group_size, std_normalize=False)  # = group mean
    last = _last_token_mask(mask)
    shifted = token_rewards - baseline[:, None] * last
    return reinforce_pp(scores, shifted, mask, values, algo)


def gae(
    scores: Tensor, token_rewards: Tensor, mask: Tensor, values: Tensor | None, algo: Any
) -> tuple[Tensor, Tensor | None]:
    """GAE with the critic's values; returns are the critic's targets."""
    if values is None:
        raise ValueError("adv_estimator=gae needs critic values")
    return A.gae(token_rewards, values, mask, gamma=algo.gamma, lam=algo.lam)


def _last_token_mask(mask: Tensor) -> Tensor:
    """(B, R) with 1 on the last valid token of each row."""
    lengths = mask.sum(-1).long()
    out = mask.new_zeros(mask.shape)
    rows = lengths > 0
    out[rows.nonzero(as_tuple=True)[0], (lengths[rows] - 1)] = 1
    return out


def token_rewards_from_scores(scores: Tensor, mask: Tensor) -> Tensor:
    """Outcome reward on the last valid token of each row, 0 elsewhere. (B,), (B, R) -> (B, R)."""
    return _last_token_mask(mask).to(scores.dtype) * scores[:, None]
