"""Advantage estimators for multi-turn (agentic) RL: episode-level group baselines, per-turn returns, GiGPO.

Data model. A batch holds B trajectories; each is one token sequence of length T (prompt excluded) that interleaves
the policy's turns with environment observations / tool outputs:

- `mask` (B, T), 0/1: 1 on the assistant tokens of every turn, 0 on observation/tool tokens and on padding, so the
  mask has *holes*.
- `turn_ids` (B, T), long: for each assistant token the index of its turn, 0..K-1; -1 elsewhere.
- `turn_rewards` (B, K), float: the environment reward of each turn, K = the largest number of turns in the batch.
- `turn_mask` (B, K), 0/1: 1 for the turns a trajectory actually took, 0 for padding turns (whose rewards may hold
  anything).
- `episode_rewards` (B,), float: one scalar per trajectory (often the sum of its turn rewards, or success).
- `group_ids` (B,), long: trajectories started from the same environment seed share a group id (a GRPO group).
  Ids are arbitrary integers, groups need not be contiguous and may have different sizes (a trajectory may have
  been dropped), so nothing here assumes a fixed group size.
- `state_keys`: B lists of hashable keys, `state_keys[b][k]` identifying the environment state that turn k of
  trajectory b acted on (the observation before the action); None (or a missing entry) for padding turns.

Conventions:
- Token-level outputs are (B, T) and 0 wherever `mask` is 0 (observation tokens and padding); per-turn outputs are
  (B, K) and 0 on padding turns.
- Group statistics follow `roll_algos.advantages.group_normalized`: std is the *sample* std (unbiased, n - 1),
  the advantage is (x - mean) / (std + eps), a group of one gets 0, and a group whose values are all equal gets
  exactly 0 (not round-off / eps).
- A trajectory with no assistant token (an all-zero `mask` row, e.g. batch padding) is absent: it takes no part in
  any group or batch statistic and its outputs are 0, whatever its rewards hold (NaN included). Likewise padding
  turns never enter a per-turn statistic.
- Rewards (and returns) that take part must be finite: a NaN or inf at a present trajectory or a valid turn is a
  ValueError naming its position, as in `roll_algos.advantages` (a NaN passed every min < max spread test, so its
  group, or the whole batch for REINFORCE++, got advantage 0 without a word; an inf gave NaN advantages).
- An episode cut short (truncated by its environment, or stopped at a turn or context limit) is scored by the
  rewards it got: its last turn's return is its last reward, nothing is estimated beyond the cut (these estimators
  have no critic to bootstrap from; GAE, which has, is refused for trajectory batches by roll_core.algorithms).
  How episodes ended is logged per step (roll_core's episode/end_<reason> metrics).
- Pure functions, tensors in and out, no gradient tracking assumed (callers pass detached rewards).

`check_trajectory_batch` validates the whole layout strictly (turn ids >= 0 exactly where the mask is 1, and so on);
the computing functions only check what they read.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from roll_algos.advantages import discounted_returns

__all__ = [
    "EPISODE_ESTIMATORS",
    "anchor_state_advantages",
    "check_trajectory_batch",
    "episode_group_advantages",
    "gigpo_advantages",
    "reinforce_pp_trajectories",
    "turn_discounted_returns",
    "turn_group_advantages",
    "turns_to_tokens",
]

EPISODE_ESTIMATORS = ("grpo", "rloo", "dr_grpo")
StateKeys = Sequence[Sequence[Hashable | None]]


# ---------------------------------------------------------------- helpers
def _segment_relative(values: Tensor, index: Tensor, valid: Tensor, *, estimator: str, eps: float) -> Tensor:
    """Group-relative advantage of 1-D `values` over the groups given by `index`, using only `valid` entries.

    Args:
        values: (N,) floats; index: (N,) integer group ids (anything where not valid); valid: (N,) bool.
        estimator: "grpo" ((x - mean) / (std + eps), std unbiased), "dr_grpo" (x - mean), "rloo"
            (x - mean of the other members).
    Returns:
        (N,) advantages, 0 where not valid and for groups of one.
    """
    out = torch.zeros_like(values)
    if not bool(valid.any()):
        return out
    x = values[valid]
    _, inv = torch.unique(index[valid], return_inverse=True)
    n_groups = int(inv.max()) + 1
    counts = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, torch.ones_like(x))
    sums = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, x)
    # A group whose values are all equal (a group of one included) gets exactly 0: comparing min and max avoids
    # dividing the round-off of x - mean by an equally tiny std.
    lo = torch.full((n_groups,), torch.inf, dtype=x.dtype, device=x.device).scatter_reduce_(0, inv, x, "amin")
    hi = torch.full((n_groups,), -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce_(0, inv, x, "amax")
    spread = (hi > lo)[inv]
    if estimator == "rloo":
        others = (sums[inv] - x) / (counts[inv] - 1).clamp_min(1)
        adv = x - others
    else:
        centered = x - (sums / counts)[inv]
        if estimator == "dr_grpo":
            adv = centered
        elif estimator == "grpo":
            sq = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, centered.square())
            std = (sq / (counts - 1).clamp_min(1)).sqrt()[inv]
            adv = centered / (std + eps)
        else:
            raise ValueError(f"unknown estimator {estimator!r}; choose one of {', '.join(EPISODE_ESTIMATORS)}")
    out[valid] = torch.where(spread, adv, 0.0)
    return out


def _check_mask(mask: Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got shape {tuple(mask.shape)}")


def _check_rows(name: str, x: Tensor, mask: Tensor) -> None:
    if x.dim() != 1 or x.shape[0] != mask.shape[0]:
        raise ValueError(
            f"{name} must be (B,) with B = {mask.shape[0]} (mask {tuple(mask.shape)}), got {tuple(x.shape)}"
        )


def _check_group_ids(group_ids: Tensor, mask: Tensor) -> None:
    _check_rows("group_ids", group_ids, mask)
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")


def _check_turns(name: str, x: Tensor, turn_mask: Tensor) -> None:
    if x.dim() != 2 or x.shape != turn_mask.shape:
        raise ValueError(f"{name} must be (B, K) like turn_mask {tuple(turn_mask.shape)}, got {tuple(x.shape)}")


def _first(cond: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in cond.nonzero()[0])


def _check_finite(name: str, x: Tensor, takes_part: Tensor) -> None:
    """Raise ValueError at the first non-finite entry of `x` (B,) or (B, K) where `takes_part`; others are free."""
    bad = takes_part & ~torch.isfinite(x)
    if bool(bad.any()):
        at = _first(bad)
        where = ", ".join(f"{dim} {i}" for dim, i in zip(("row", "turn"), at))
        raise ValueError(
            f"{name} is not finite at ({where}) (value {float(x[at])}; {int(bad.sum())} such entries): "
            "score non-finite rewards before computing advantages"
        )


# ---------------------------------------------------------------- validation
def check_trajectory_batch(
    mask: Tensor,
    turn_ids: Tensor,
    *,
    turn_mask: Tensor | None = None,
    turn_rewards: Tensor | None = None,
    episode_rewards: Tensor | None = None,
    group_ids: Tensor | None = None,
    state_keys: StateKeys | None = None,
    num_turns: int | None = None,
) -> None:
    """Validate a multi-turn batch; raise ValueError naming the first offending position.

    Checks: `mask` is (B, T) and 0/1; `turn_ids` is an integer (B, T) tensor with turn_ids >= 0 exactly where
    mask is 1; every turn index is < K, where K comes from `turn_mask`, `turn_rewards` or `num_turns` (they must
    agree); `turn_mask`/`turn_rewards` are (B, K), `turn_mask` 0/1, and every assistant token's turn has turn_mask 1;
    `episode_rewards` and `group_ids` are (B,) (group ids integer); `state_keys` has B rows of at most K entries,
    a hashable key for every valid turn.

    Args:
        mask: (B, T); turn_ids: (B, T); turn_mask, turn_rewards: (B, K); episode_rewards, group_ids: (B,).
    Returns:
        None.
    """
    _check_mask(mask)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"mask must hold only 0 and 1; first other value at {_first((mask != 0) & (mask != 1))}")
    if turn_ids.shape != mask.shape:
        raise ValueError(f"turn_ids must be (B, T) like mask {tuple(mask.shape)}, got {tuple(turn_ids.shape)}")
    if turn_ids.dtype.is_floating_point or turn_ids.dtype.is_complex or turn_ids.dtype == torch.bool:
        raise ValueError(f"turn_ids must be an integer tensor, got {turn_ids.dtype}")
    valid = mask.bool()
    mismatch = (turn_ids >= 0) != valid
    if bool(mismatch.any()):
        b, t = _first(mismatch)
        raise ValueError(
            f"turn_ids must be >= 0 exactly where mask is 1: at (row {b}, token {t}) mask = {int(mask[b, t])} "
            f"but turn_ids = {int(turn_ids[b, t])}"
        )
    sizes = {}
    for name, x in (("turn_mask", turn_mask), ("turn_rewards", turn_rewards)):
        if x is not None:
            if x.dim() != 2 or x.shape[0] != mask.shape[0]:
                raise ValueError(f"{name} must be (B, K) with B = {mask.shape[0]}, got {tuple(x.shape)}")
            sizes[name] = x.shape[1]
    if num_turns is not None:
        sizes["num_turns"] = num_turns
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the number of turns K disagrees: {sizes}")
    k = next(iter(sizes.values()), None)
    if k is not None and bool((turn_ids >= k).any()):
        b, t = _first(turn_ids >= k)
        raise ValueError(f"turn index {int(turn_ids[b, t])} at (row {b}, token {t}) is out of range for K = {k} turns")
    if turn_mask is not None:
        if bool(((turn_mask != 0) & (turn_mask != 1)).any()):
            raise ValueError("turn_mask must hold only 0 and 1")
        on_padding = valid & ~turn_mask.bool().gather(1, turn_ids.clamp_min(0).long()) if k else valid
        if bool(on_padding.any()):
            b, t = _first(on_padding)
            raise ValueError(
                f"assistant token (row {b}, token {t}) belongs to turn {int(turn_ids[b, t])}, whose turn_mask is 0"
            )
    if episode_rewards is not None:
        _check_rows("episode_rewards", episode_rewards, mask)
    if group_ids is not None:
        _check_group_ids(group_ids, mask)
    if state_keys is not None:
        if turn_mask is None:
            raise ValueError("checking state_keys needs turn_mask")
        _state_keys_for(state_keys, turn_mask.bool())


def _state_keys_for(state_keys: StateKeys, turn_valid: Tensor) -> list[list[Hashable]]:
    """The key of every valid turn, row by row; raise on a wrong row count, an overlong row or a missing key."""
    b_size, k_size = turn_valid.shape
    if len(state_keys) != b_size:
        raise ValueError(f"state_keys must have B = {b_size} rows, got {len(state_keys)}")
    flags = turn_valid.tolist()
    rows: list[list[Hashable]] = []
    for b, (keys, row_flags) in enumerate(zip(state_keys, flags)):
        if len(keys) > k_size:
            raise ValueError(f"state_keys row {b} has {len(keys)} entries, more than K = {k_size} turns")
        row = []
        for k, is_valid in enumerate(row_flags):
            if not is_valid:
                continue
            key = keys[k] if k < len(keys) else None
            if key is None:
                raise ValueError(f"state_keys[{b}][{k}] is missing (None) but turn {k} of row {b} is valid")
            try:
                hash(key)
            except TypeError as err:
                raise ValueError(f"state_keys[{b}][{k}] = {key!r} is not hashable (use a tuple or str)") from err
            row.append(key)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- episode level
def episode_group_advantages(
    episode_rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
) -> Tensor:
    """Trajectory-level group-relative advantage, broadcast to every assistant token of the trajectory.

    With n the size of trajectory i's group g (trajectories with at least one assistant token only):
    - "grpo": (R_i - mean_g) / (std_g + eps), std_g unbiased (n - 1), 0 when std_g = 0;
    - "rloo": R_i - (sum_g R - R_i) / (n - 1) (leave-one-out baseline);
    - "dr_grpo": R_i - mean_g (Dr.GRPO: no std division).
    Groups of one get 0. Groups are given by ids, of any sizes, in any order.

    Args:
        episode_rewards: (B,) float.
        group_ids: (B,) integer.
        mask: (B, T) 0/1 assistant-token mask (with holes).
        estimator: one of `EPISODE_ESTIMATORS`.
    Returns:
        (B, T) advantages, 0 where mask is 0.
    """
    _check_mask(mask)
    _check_rows("episode_rewards", episode_rewards, mask)
    _check_group_ids(group_ids, mask)
    if estimator not in EPISODE_ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; choose one of {', '.join(EPISODE_ESTIMATORS)}")
    valid = mask.bool()
    present = valid.any(dim=-1)
    _check_finite("episode_rewards", episode_rewards, present)
    adv = _segment_relative(episode_rewards, group_ids, present, estimator=estimator, eps=eps)
    return torch.where(valid, adv[:, None], 0.0)


def reinforce_pp_trajectories(
    episode_rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++ over trajectories: whiten the episode rewards over the batch, broadcast to the tokens.

    A_i = (R_i - mean_B) / (std_B + eps), std unbiased, over the trajectories with at least one assistant token;
    0 when fewer than two or std_B = 0. Normalisation is over *trajectories* (each counts once, as in
    `roll_algos.advantages.batch_normalized`), not over tokens as in OpenRLHF's token-level whitening, which would
    weight long trajectories by their token count. With `group_ids`, REINFORCE++-baseline: each reward first has
    its group mean subtracted (groups of one give 0), then the batch whitening applies.

    Args:
        episode_rewards: (B,) float; mask: (B, T) 0/1; group_ids: optional (B,) integer.
    Returns:
        (B, T) advantages, 0 where mask is 0.
    """
    _check_mask(mask)
    _check_rows("episode_rewards", episode_rewards, mask)
    valid = mask.bool()
    present = valid.any(dim=-1)
    _check_finite("episode_rewards", episode_rewards, present)
    scores = torch.where(present, episode_rewards, 0.0)
    if group_ids is not None:
        _check_group_ids(group_ids, mask)
        scores = _segment_relative(scores, group_ids, present, estimator="dr_grpo", eps=eps)
    index = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    adv = _segment_relative(scores, index, present, estimator="grpo", eps=eps)
    return torch.where(valid, adv[:, None], 0.0)


# ---------------------------------------------------------------- turn level
def turn_discounted_returns(turn_rewards: Tensor, turn_mask: Tensor, *, gamma: float) -> Tensor:
    """Per-turn discounted return G_k = r_k + gamma * G_{k'}, k' the next valid turn (G = 0 after the last one).

    Padding turns are skipped, not treated as zero-reward turns, and their rewards never contribute.

    Args:
        turn_rewards: (B, K) float; turn_mask: (B, K) 0/1.
        gamma: discount per turn.
    Returns:
        (B, K) returns, 0 on padding turns.
    """
    _check_turns("turn_rewards", turn_rewards, turn_mask)
    return discounted_returns(turn_rewards, turn_mask, gamma=gamma)


def turns_to_tokens(per_turn: Tensor, turn_ids: Tensor, mask: Tensor) -> Tensor:
    """Place each turn's value on every assistant token of that turn.

    Args:
        per_turn: (B, K) values; turn_ids: (B, T) turn index of each assistant token (read only where mask is 1);
        mask: (B, T) 0/1.
    Returns:
        (B, T): out[b, t] = per_turn[b, turn_ids[b, t]] where mask is 1, else 0.
    """
    _check_mask(mask)
    if turn_ids.shape != mask.shape:
        raise ValueError(f"turn_ids must be (B, T) like mask {tuple(mask.shape)}, got {tuple(turn_ids.shape)}")
    if per_turn.dim() != 2 or per_turn.shape[0] != mask.shape[0]:
        raise ValueError(f"per_turn must be (B, K) with B = {mask.shape[0]}, got {tuple(per_turn.shape)}")
    valid = mask.bool()
    k = per_turn.shape[1]
    bad = valid & ((turn_ids < 0) | (turn_ids >= k))
    if bool(bad.any()):
        b, t = _first(bad)
        raise ValueError(f"assistant token (row {b}, token {t}) has turn index {int(turn_ids[b, t])}, not in [0, {k})")
    if k == 0:
        return torch.zeros(mask.shape, dtype=per_turn.dtype, device=per_turn.device)
    idx = torch.where(valid, turn_ids, 0).long()
    return torch.where(valid, per_turn.gather(1, idx), 0.0)


# ---------------------------------------------------------------- GiGPO
def anchor_state_advantages(
    turn_returns: Tensor,
    turn_mask: Tensor,
    group_ids: Tensor,
    state_keys: StateKeys,
    *,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> Tensor:
    """GiGPO's step-level advantage A^S per turn, normalised within anchor-state step groups.

    The step group of turn k of trajectory b is every valid turn (b', k') with group_ids[b'] = group_ids[b] and
    state_keys[b'][k'] == state_keys[b][k], at any turn index, a trajectory that revisits a state contributing every
    visit. A^S = (R - mean) / (std + eps) over the step group (std unbiased, n - 1; 0 when std = 0), or R - mean
    with `normalize_std=False`; step groups of one get 0.

    Args:
        turn_returns: (B, K) per-turn discounted returns (`turn_discounted_returns`).
        turn_mask: (B, K) 0/1; group_ids: (B,) integer; state_keys: B rows of hashable keys, None on padding turns.
    Returns:
        (B, K) step advantages, 0 on padding turns.
    """
    _check_turns("turn_returns", turn_returns, turn_mask)
    _check_group_ids(group_ids, turn_mask)
    turn_valid = turn_mask.bool()
    _check_finite("turn_returns", turn_returns, turn_valid)
    rows = _state_keys_for(state_keys, turn_valid)
    step_group = torch.zeros(turn_mask.shape, dtype=torch.long)
    ids: dict[tuple[int, Hashable], int] = {}
    flags = turn_valid.tolist()
    for b, (gid, keys) in enumerate(zip(group_ids.tolist(), rows)):
        it = iter(keys)
        for k, is_valid in enumerate(flags[b]):
            if is_valid:
                step_group[b, k] = ids.setdefault((gid, next(it)), len(ids))
    estimator = "grpo" if normalize_std else "dr_grpo"
    adv = _segment_relative(
        turn_returns.reshape(-1),
        step_group.to(turn_returns.device).reshape(-1),
        turn_valid.reshape(-1),
        estimator=estimator,
        eps=eps,
    )
    return adv.view_as(turn_returns)


def gigpo_advantages(
    episode_rewards: Tensor,
    turn_rewards: Tensor,
    turn_mask: Tensor,
    group_ids: Tensor,
    state_keys: StateKeys,
    turn_ids: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    step_weight: float = 1.0,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> Tensor:
    """GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent Training", arXiv:2505.10978).

    A(token of turn k of trajectory i) = A^E(i) + step_weight * A^S(i, k), where
    - A^E is the episode-level group advantage of `episode_group_advantages` ("grpo" with `normalize_std`, else
      "dr_grpo": the paper's F_norm = std or 1), over the trajectories of the group;
    - A^S is the step-level advantage of `anchor_state_advantages`: the discounted return from turn k,
      G_k = sum_{j>=k} gamma^{j-k} r_j (`turn_discounted_returns`), normalised over the anchor-state step group,
      the valid turns of the same trajectory group whose state before the action has the same key. The same
      `normalize_std` applies to both levels, as in verl-agent's `mode` switch.
    Trajectories without assistant tokens are absent from both levels. Differences from verl-agent's reference
    implementation: its episode level gives a group of one the raw reward (mean 0, std 1) where this gives 0, and
    it pools the episode statistics over per-step rows (one per turn); here each trajectory counts once (Eq. 3).

    Args:
        episode_rewards: (B,); turn_rewards, turn_mask: (B, K); group_ids: (B,) integer; state_keys: B rows of
        hashable keys (None on padding turns); turn_ids, mask: (B, T).
        gamma: per-turn discount; step_weight: omega, the weight of A^S.
    Returns:
        (B, T) advantages, 0 where mask is 0.
    """
    _check_turns("turn_rewards", turn_rewards, turn_mask)
    if turn_mask.shape[0] != mask.shape[0]:
        raise ValueError(f"turn_mask {tuple(turn_mask.shape)} and mask {tuple(mask.shape)} disagree on B")
    estimator = "grpo" if normalize_std else "dr_grpo"
    episode = episode_group_advantages(episode_rewards, group_ids, mask, estimator=estimator, eps=eps)
    present = mask.bool().any(dim=-1)
    turn_valid = turn_mask.bool() & present[:, None]
    _check_finite("turn_rewards", turn_rewards, turn_valid)
    returns = turn_discounted_returns(turn_rewards, turn_valid, gamma=gamma)
    step = anchor_state_advantages(returns, turn_valid, group_ids, state_keys, eps=eps, normalize_std=normalize_std)
    return episode + step_weight * turns_to_tokens(step, turn_ids, mask)


def turn_group_advantages(
    turn_rewards: Tensor,
    turn_mask: Tensor,
    group_ids: Tensor,
    turn_ids: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    estimator: str = "grpo",
    eps: float = 1e-6,
) -> Tensor:
    """Per-turn rewards: each turn's discounted return G_k, made group-relative over every valid turn of the
    trajectories of its group, placed on that turn's assistant tokens (`turn_grpo`).

    Args:
        turn_rewards: (B, K); turn_mask: (B, K) 0/1; group_ids: (B,); turn_ids: (B, T); mask: (B, T) 0/1.
        gamma: discount per turn; estimator: "grpo", "dr_grpo" or "rloo" over the group's turns.
    Returns:
        (B, T) advantages, 0 where `mask` is 0 and for trajectories without assistant tokens.
    """
    _check_mask(mask)
    _check_turns("turn_rewards", turn_rewards, turn_mask)
    _check_group_ids(group_ids, mask)
    present = mask.bool().any(dim=1)  # trajectories with no assistant token take no part
    valid_turn = turn_mask.bool() & present[:, None]
    _check_finite("turn_rewards", turn_rewards, valid_turn)
    returns = turn_discounted_returns(torch.where(valid_turn, turn_rewards, 0.0), valid_turn.float(), gamma=gamma)
    index = group_ids[:, None].expand_as(returns)
    per_turn = _segment_relative(
        returns.reshape(-1), index.reshape(-1), valid_turn.reshape(-1), estimator=estimator, eps=eps
    ).reshape(returns.shape)
    return turns_to_tokens(per_turn, turn_ids, mask)
