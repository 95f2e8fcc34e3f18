"""Advantage estimators, one registry (`roll.algorithms`) for outcome and trajectory estimators.

Contract: an estimator maps `AdvantageInputs` and the algo config to per-token advantages (B, R) and, for
value-based estimators, returns (B, R). Outcome batches (single-turn RLVR) hold `group_size` consecutive rows per
prompt; trajectory batches (agentic) carry `group_ids` (B,) (episodes of one environment seed; groups may be
short when an environment failed) and `turns` (per-turn rewards, masks, ids, state keys). An estimator that needs
turns sets `needs_turns = True`; one that has no trajectory form sets `trajectories = False`; both are checked
when a run is built, not at its first step. Out-of-tree estimators register a function with this signature under
`roll.algorithms` and are selected by `algo.adv_estimator=<name>`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from roll_algos import advantages as adv_ops
from roll_algos import trajectories as traj_ops


@dataclass
class AdvantageInputs:
    """What an estimator reads. Shapes: B rows, R response tokens."""

    #: (B,) outcome per row (the episode reward for trajectories).
    scores: Tensor
    #: (B, R) outcome on the last valid token minus any KL penalty (algo.kl_in_reward).
    token_rewards: Tensor
    #: (B, R) 0/1 tokens trained on (with holes at observations for trajectories).
    mask: Tensor
    #: (B, R) critic values, or None without a critic.
    values: Tensor | None = None
    #: (B,) long group of each trajectory; None for outcome batches (consecutive groups of algo.group_size).
    group_ids: Tensor | None = None
    #: Trajectory turns: turn_rewards (B, T), turn_mask (B, T), turn_ids (B, R), state_keys (B lists of T).
    turns: Mapping[str, Any] | None = None


class AdvantageEstimator(Protocol):
    def __call__(self, x: AdvantageInputs, algo: Any) -> tuple[Tensor, Tensor | None]: ...


Estimator = Callable[[AdvantageInputs, Any], tuple[Tensor, Tensor | None]]

#: roll-core's estimators that never read `algo.gamma` (group baselines of the outcome: no per-token return to
#: discount); the config refuses a gamma < 1 with them. Out-of-tree estimators are never listed: they may read it.
NO_GAMMA = ("grpo", "dr_grpo", "rloo")
#: ... and those that never read it on trajectory batches (reinforce_pp whitens the episode rewards there);
#: `load_estimator(trajectories=True)` refuses a gamma < 1 with them.
NO_GAMMA_TRAJECTORIES = (*NO_GAMMA, "reinforce_pp")
#: roll-core's estimators that never read `algo.lam` (only gae does); the config refuses a lam < 1 with them.
NO_LAM = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gigpo", "turn_grpo")


def _kind(*, trajectories: bool = True, needs_turns: bool = False) -> Callable[[Estimator], Estimator]:
    def mark(fn: Estimator) -> Estimator:
        fn.trajectories = trajectories  # type: ignore[attr-defined]
        fn.needs_turns = needs_turns  # type: ignore[attr-defined]
        return fn

    return mark


def _group_relative(x: AdvantageInputs, algo: Any, name: str) -> Tensor:
    if x.group_ids is not None:
        return traj_ops.episode_group_advantages(x.scores, x.group_ids, x.mask, estimator=name)
    if name == "rloo":
        seq = adv_ops.leave_one_out(x.scores, algo.group_size)
    else:  # algo.norm_mean_type / norm_std_type, where set, replace the estimator's own (lite_ppo: group / batch)
        mean_type = getattr(algo, "norm_mean_type", None) or "group"
        std_type = getattr(algo, "norm_std_type", None) or ("group" if name == "grpo" else "none")
        seq = adv_ops.reward_normalized(x.scores, algo.group_size, mean_type=mean_type, std_type=std_type)
    return adv_ops.broadcast_to_tokens(seq, x.mask)


@_kind()
def grpo(x: AdvantageInputs, algo: Any) -> tuple[Tensor, Tensor | None]:
    """(r - group mean) / group std on every token."""
    return _group_relative(x, algo, "grpo"), None


@_kind()
def dr_grpo(x: AdvantageInputs, algo: Any) -> tuple[Tensor, Tensor | None]:
    """r - group mean on every token (no std normalisation)."""
    return _group_relative(x, algo, "dr_grpo"), None


@_kind()
def rloo(x: AdvantageInputs, algo: Any) -> tuple[Tensor, Tensor | None]:
    """Leave-one-out baseline on every token."""
    return _group_relative(x, algo, "rloo"), None


@_kind()
def reinforce_pp(x: AdvantageInputs, algo: Any) -> tuple[Tensor, Tensor | None]:
    """Outcome: the discounted return of the token rewards, whitened over the batch's tokens. Trajectories: the
    episode rewards whitened over the batch's trajectories (each counts once)."""
    if x.group_ids is not None:
        return traj_ops.reinforce_pp_trajectories(x.scores, x.mask), None
    returns = adv_ops.discounted_returns(x.token_rewards, x.mask, gamma=algo.gamma)
    return adv_ops.whiten(returns, x.mask), None


@_kind(trajectories=False)
def reinforce_pp_baseline(x: AdvantageInputs, algo: Any) -> tuple[Tensor, Tensor | None]:
    """Subtract each group's mean outcome from the token rewards, then as reinforce_pp."""
    baseline = x.scores - adv_ops.group_normalized(x.scores, algo.group_size, std_normalize=False)  # = group mean
    shifted = x.token_rewards - baseline[:, None] * _last_token_mask(x.mask)
    returns = adv_ops.discounted_returns(shifted, x.mask, gamma=algo.gamma)
    return adv_ops.whiten(returns, x.mask), None


@_kind(trajectories=False)
def gae(x: AdvantageInputs, algo: Any) -> tuple[Tensor, Tensor | None]:
    """GAE with the critic's values; returns are the critic's targets."""
    if x.values is None:
        raise ValueError("adv_estimator=gae needs critic values")
    return adv_ops.gae(x.token_rewards, x.values, x.mask, gamma=algo.gamma, lam=algo.lam)


@_kind(needs_turns=True)
def gigpo(x: AdvantageInputs, algo: Any) -> tuple[Tensor, Tensor | None]:
    """GiGPO: episode-level group advantage plus a step-level one over identical environment states."""
    t = _turns(x)
    adv = traj_ops.gigpo_advantages(
        x.scores,
        t["turn_rewards"],
        t["turn_mask"],
        x.group_ids,
        t["state_keys"],
        t["turn_ids"],
        x.mask,
        gamma=algo.gamma,
    )
    return adv, None


@_kind(needs_turns=True)
def turn_grpo(x: AdvantageInputs, algo: Any) -> tuple[Tensor, Tensor | None]:
    """Per-turn rewards: each turn's discounted return relative to the group's turns."""
    t = _turns(x)
    adv = traj_ops.turn_group_advantages(
        t["turn_rewards"], t["turn_mask"], x.group_ids, t["turn_ids"], x.mask, gamma=algo.gamma
    )
    return adv, None


def _turns(x: AdvantageInputs) -> Mapping[str, Any]:
    if x.turns is None or x.group_ids is None:
        raise ValueError("this estimator groups the turns of multi-turn episodes: use pipeline=agentic")
    return x.turns


def _last_token_mask(mask: Tensor) -> Tensor:
    """(B, R) with 1 on the last valid token of each row: its position, not its count of valid tokens (a
    multi-turn trajectory's mask has holes: observation tokens between the turns)."""
    valid = mask > 0
    last = (valid.long() * torch.arange(1, mask.shape[-1] + 1, device=mask.device)).argmax(-1)
    out = mask.new_zeros(mask.shape)
    rows = valid.any(-1)
    out[rows.nonzero(as_tuple=True)[0], last[rows]] = 1
    return out


def token_rewards_from_scores(scores: Tensor, mask: Tensor) -> Tensor:
    """Outcome reward on the last valid token of each row, 0 elsewhere. (B,), (B, R) -> (B, R)."""
    return _last_token_mask(mask).to(scores.dtype) * scores[:, None]


def load_estimator(name: str, *, trajectories: bool, gamma: float = 1.0) -> Estimator:
    """The `roll.algorithms` estimator `name`, checked against the batches it will see (a ConfigError if not).

    `gamma` is `algo.gamma`: a discount < 1 that `name` never reads on these batches (`NO_GAMMA_TRAJECTORIES`;
    the config itself refuses `NO_GAMMA`, which ignore it on every batch) is refused, not silently ignored."""
    from roll_core import registry
    from roll_core.errors import ConfigError

    est = registry.load("roll.algorithms", name)
    if trajectories and gamma != 1.0 and name in NO_GAMMA_TRAJECTORIES:
        raise ConfigError(
            f"algo.gamma={gamma} discounts per-token or per-turn returns; algo.adv_estimator={name} on trajectory "
            "batches (pipeline=agentic) uses each episode's reward undiscounted and would ignore it: set "
            "algo.gamma=1, or use adv_estimator=turn_grpo or gigpo (they discount per turn)"
        )
    if getattr(est, "needs_turns", False) and not trajectories:
        raise ConfigError(f"algo.adv_estimator={name} groups steps of multi-turn episodes: use pipeline=agentic")
    if trajectories and not getattr(est, "trajectories", True):
        names = [n for n in registry.available("roll.algorithms") if _supports_trajectories(n)]
        raise ConfigError(
            f"algo.adv_estimator={name} has no trajectory form: use one of {', '.join(sorted(names))} with "
            "pipeline=agentic"
        )
    return est


def _supports_trajectories(name: str) -> bool:
    from roll_core import registry

    try:
        return bool(getattr(registry.load("roll.algorithms", name), "trajectories", True))
    except Exception:  # a broken out-of-tree plugin is reported when it is chosen, not while listing
        return False
