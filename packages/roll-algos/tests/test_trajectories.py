"""Multi-turn advantages (episode groups, REINFORCE++, per-turn returns, GiGPO): hand-computed values and properties."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roll_algos.advantages import group_baseline_batch_normalized, group_normalized, leave_one_out
from roll_algos.trajectories import (
    EPISODE_ESTIMATORS,
    anchor_state_advantages,
    check_trajectory_batch,
    episode_group_advantages,
    gigpo_advantages,
    reinforce_pp_trajectories,
    turn_discounted_returns,
    turn_group_advantages,
    turns_to_tokens,
)

T = torch.tensor
NAN = float("nan")


def close(a: torch.Tensor, b: list | torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


# ---------------------------------------------------------------- episode level by hand
# Six trajectories, group ids not contiguous and of sizes 3, 1 and 2. Masks have holes (observation tokens) and
# padding; every row has at least one assistant token.
EP_REWARDS = T([1.0, 5.0, 0.0, 2.0, 6.0, 2.0])
EP_GROUPS = T([4, 9, 4, 2, 2, 4])
EP_MASK = T(
    [
        [1, 0, 1, 0],
        [1, 1, 1, 1],
        [0, 1, 0, 0],
        [1, 0, 0, 1],
        [1, 1, 0, 0],
        [0, 0, 1, 1],
    ]
)


def per_row(values: list[float]) -> list[list[float]]:
    """Expected token advantages: each row's value on its mask."""
    return [[v * m for m in row] for v, row in zip(values, EP_MASK.tolist())]


def test_episode_grpo_by_hand_variable_groups() -> None:
    # group 4 = rows 0, 2, 5: [1, 0, 2], mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1 -> [0, -1, 1]
    # group 9 = row 1 alone -> 0
    # group 2 = rows 3, 4: [2, 6], mean 4, unbiased std sqrt((4 + 4) / 1) = 2*sqrt2 -> [-1/sqrt2, 1/sqrt2]
    adv = episode_group_advantages(EP_REWARDS, EP_GROUPS, EP_MASK, estimator="grpo", eps=0.0)
    s = 1 / math.sqrt(2)
    close(adv, per_row([0.0, 0.0, -1.0, -s, s, 1.0]))


def test_episode_dr_grpo_by_hand() -> None:
    # mean-centred only: group 4 [1, 0, 2] - 1 = [0, -1, 1]; group 2 [2, 6] - 4 = [-2, 2]; group of one 0
    adv = episode_group_advantages(EP_REWARDS, EP_GROUPS, EP_MASK, estimator="dr_grpo")
    close(adv, per_row([0.0, 0.0, -1.0, -2.0, 2.0, 1.0]))


def test_episode_rloo_by_hand() -> None:
    # group 4 [1, 0, 2]: means of the others (0+2)/2 = 1, (1+2)/2 = 1.5, (1+0)/2 = 0.5 -> [0, -1.5, 1.5]
    # group 2 [2, 6]: 2 - 6 = -4, 6 - 2 = 4; group of one -> 0
    adv = episode_group_advantages(EP_REWARDS, EP_GROUPS, EP_MASK, estimator="rloo")
    close(adv, per_row([0.0, 0.0, -1.5, -4.0, 4.0, 1.5]))


def test_all_masked_row_is_absent() -> None:
    # Row 2 has no assistant token: it leaves its group (reward NaN is ignored) and gets 0.
    # group [1, 3]: mean 2, unbiased std sqrt(2) -> [-1/sqrt2, 1/sqrt2]
    mask = T([[1, 0, 1], [0, 1, 0], [0, 0, 0]])
    adv = episode_group_advantages(T([1.0, 3.0, NAN]), T([0, 0, 0]), mask, eps=0.0)
    s = 1 / math.sqrt(2)
    close(adv, [[-s, 0.0, -s], [0.0, s, 0.0], [0.0, 0.0, 0.0]])
    # a group left with one present trajectory: 0
    close(episode_group_advantages(T([1.0, NAN]), T([3, 3]), T([[1, 1], [0, 0]])), [[0.0, 0.0], [0.0, 0.0]])


def test_all_equal_group_is_exactly_zero() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point; the min == max check still gives exactly 0 even with eps = 0.
    for est in EPISODE_ESTIMATORS:
        adv = episode_group_advantages(T([0.1, 0.1, 0.1]), T([1, 1, 1]), torch.ones(3, 2), estimator=est, eps=0.0)
        assert bool((adv == 0).all()), est


def test_reinforce_pp_by_hand() -> None:
    # present rows [1, 2, 3] (row 3 all-masked, NaN ignored): mean 2, unbiased std 1 -> [-1, 0, 1]
    mask = T([[1, 0], [0, 1], [1, 1], [0, 0]])
    adv = reinforce_pp_trajectories(T([1.0, 2.0, 3.0, NAN]), mask, eps=0.0)
    close(adv, [[-1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    # fewer than two trajectories, or all equal -> 0
    close(reinforce_pp_trajectories(T([5.0]), T([[1, 1]])), [[0.0, 0.0]])
    close(reinforce_pp_trajectories(T([5.0, 5.0]), T([[1], [1]])), [[0.0], [0.0]])


def test_reinforce_pp_baseline_by_hand() -> None:
    # groups 7 = [1, 3] and 8 = [10, 10] (rows interleaved): centred [-1, 0, 1, 0];
    # batch mean 0, unbiased std sqrt(2/3) = 0.816497 -> [-1.224745, 0, 1.224745, 0]
    rewards, groups = T([1.0, 10.0, 3.0, 10.0]), T([7, 8, 7, 8])
    adv = reinforce_pp_trajectories(rewards, torch.ones(4, 1), group_ids=groups, eps=0.0)
    close(adv, [[-1.224745], [0.0], [1.224745], [0.0]])
    # same as the contiguous-group function on the reordered batch
    ref = group_baseline_batch_normalized(T([1.0, 3.0, 10.0, 10.0]), 2, eps=0.0)
    close(adv[[0, 2, 1, 3], 0], ref)


# ---------------------------------------------------------------- turn level by hand
def test_turn_discounted_returns_gamma_half_by_hand() -> None:
    # row 0: r = [1, 0, 2], padding turn 3 (NaN ignored): G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    # row 1: valid turns 0 and 2 only (turn 1 is a hole, skipped): G2 = 4, G0 = 1 + 0.5*4 = 3
    # row 2: no turns -> 0
    rewards = T([[1.0, 0.0, 2.0, NAN], [1.0, 9.0, 4.0, 0.0], [NAN, NAN, NAN, NAN]])
    tmask = T([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    close(turn_discounted_returns(rewards, tmask, gamma=0.5), [[1.5, 1.0, 2.0, 0.0], [3.0, 0.0, 4.0, 0.0], [0] * 4])


def test_turns_to_tokens_by_hand() -> None:
    # tokens: turn 0, observation, turn 1, turn 1, padding; values of masked positions are never read
    per_turn = T([[10.0, 20.0, NAN], [-1.0, NAN, NAN]])
    turn_ids = T([[0, -1, 1, 1, -1], [0, 0, 7, -1, -1]])
    mask = T([[1, 0, 1, 1, 0], [1, 1, 0, 0, 0]])
    close(turns_to_tokens(per_turn, turn_ids, mask), [[10.0, 0.0, 20.0, 20.0, 0.0], [-1.0, -1.0, 0.0, 0.0, 0.0]])


# ---------------------------------------------------------------- GiGPO by hand
# Group 7 has trajectories A, B, C; group 3 has D alone. gamma = 0.5, K = 3, sparse graded rewards.
#   A: states [s0, s1],     turn rewards [0, 1]      -> returns [0 + 0.5*1, 1] = [0.5, 1];   episode reward 1
#   B: states [s0, s2, s1], turn rewards [0, 0, 0.4] -> G2 = 0.4, G1 = 0.5*0.4 = 0.2, G0 = 0.1; episode 0.4
#   C: states [s0, s2, s2], turn rewards [0, 0, 0]   -> [0, 0, 0] (C loops on s2: both visits count); episode 0
#   D: states [s0, s1],     turn rewards [0, 1]      -> [0.5, 1]; episode 1 (same keys as group 7, other group)
# A and B visit s1 at different turns (1 and 2).
G_TURN_REWARDS = T([[0.0, 1.0, NAN], [0.0, 0.0, 0.4], [0.0, 0.0, 0.0], [0.0, 1.0, NAN]])
G_TURN_MASK = T([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
G_EPISODE = T([1.0, 0.4, 0.0, 1.0])
G_GROUPS = T([7, 7, 7, 3])
G_KEYS = [["s0", "s1", None], ["s0", "s2", "s1"], ["s0", "s2", "s2"], ["s0", "s1"]]  # rows may be short
# tokens: A: t0 t0 obs t1 t1 pad pad pad; B: t0 obs t1 obs t2 t2 pad pad; C: t0 obs t1 t1 obs t2 pad pad;
# D: t0 obs obs t1 pad pad pad pad
G_TURN_IDS = T(
    [
        [0, 0, -1, 1, 1, -1, -1, -1],
        [0, -1, 1, -1, 2, 2, -1, -1],
        [0, -1, 1, 1, -1, 2, -1, -1],
        [0, -1, -1, 1, -1, -1, -1, -1],
    ]
)
G_MASK = (G_TURN_IDS >= 0).long()

# Episode level, group 7: R = [1, 0.4, 0], mean 7/15, deviations [8/15, -1/15, -7/15],
#   unbiased var = (64 + 1 + 49) / 225 / 2 = 0.253333, std 0.503322 -> [1.059626, -0.132453, -0.927173]; D: 0.
EP_7 = [1.059626, -0.132453, -0.927173]
# Step level, step groups of group 7:
#   s0: A0 0.5, B0 0.1, C0 0: mean 0.2, dev [0.3, -0.1, -0.2], var (0.09 + 0.01 + 0.04)/2 = 0.07, std 0.264575
#       -> [1.133893, -0.377964, -0.755929]
#   s1: A1 1, B2 0.4: mean 0.7, dev [0.3, -0.3], var 0.18, std 0.424264 -> [0.707107, -0.707107]
#   s2: B1 0.2, C1 0, C2 0: mean 1/15, dev [2/15, -1/15, -1/15], var 0.013333, std 0.115470
#       -> [1.154701, -0.577350, -0.577350]
#   D's (3, s0) and (3, s1) are step groups of one -> 0.
STEP = [[1.133893, 0.707107, 0.0], [-0.377964, 1.154701, -0.707107], [-0.755929, -0.577350, -0.577350], [0, 0, 0]]
STEP_MEAN_ONLY = [[0.3, 0.3, 0.0], [-0.1, 2 / 15, -0.3], [-0.2, -1 / 15, -1 / 15], [0, 0, 0]]


def test_anchor_state_advantages_by_hand() -> None:
    returns = turn_discounted_returns(G_TURN_REWARDS, G_TURN_MASK, gamma=0.5)
    close(returns, [[0.5, 1.0, 0.0], [0.1, 0.2, 0.4], [0.0, 0.0, 0.0], [0.5, 1.0, 0.0]])
    close(anchor_state_advantages(returns, G_TURN_MASK, G_GROUPS, G_KEYS, eps=0.0), STEP)
    close(anchor_state_advantages(returns, G_TURN_MASK, G_GROUPS, G_KEYS, normalize_std=False), STEP_MEAN_ONLY)


def gigpo_by_hand(episode: list[float], step: list[list[float]], weight: float) -> list[list[float]]:
    """A = A^E(row) + weight * A^S(row, turn of the token), 0 off the mask."""
    return [
        [(episode[b] + weight * step[b][k]) if k >= 0 else 0.0 for k in row]
        for b, row in enumerate(G_TURN_IDS.tolist())
    ]


def test_gigpo_by_hand() -> None:
    adv = gigpo_advantages(
        G_EPISODE, G_TURN_REWARDS, G_TURN_MASK, G_GROUPS, G_KEYS, G_TURN_IDS, G_MASK, gamma=0.5, eps=0.0
    )
    close(adv, gigpo_by_hand([*EP_7, 0.0], STEP, 1.0))
    # e.g. B's turn-1 tokens (t = 2): -0.132453 + 1.154701 = 1.022248; A's observation token (t = 2) stays 0
    close(adv[1, 2], 1.022248)
    assert adv[0, 2] == 0
    # omega = 0.5 and the mean-only variant (Dr.GRPO episode part: [8/15, -1/15, -7/15])
    adv = gigpo_advantages(
        G_EPISODE,
        G_TURN_REWARDS,
        G_TURN_MASK,
        G_GROUPS,
        G_KEYS,
        G_TURN_IDS,
        G_MASK,
        gamma=0.5,
        step_weight=0.5,
        normalize_std=False,
    )
    close(adv, gigpo_by_hand([8 / 15, -1 / 15, -7 / 15, 0.0], STEP_MEAN_ONLY, 0.5))


def test_gigpo_step_sign_can_differ_from_episode_sign() -> None:
    # B failed relative to its group (A^E = -0.132453 < 0), but at s2 it did better than C (A^S = +1.154701):
    # GiGPO credits that turn positively, the episode advantage alone penalises it.
    episode = episode_group_advantages(G_EPISODE, G_GROUPS, G_MASK, eps=0.0)
    adv = gigpo_advantages(
        G_EPISODE, G_TURN_REWARDS, G_TURN_MASK, G_GROUPS, G_KEYS, G_TURN_IDS, G_MASK, gamma=0.5, eps=0.0
    )
    assert episode[1, 2] < 0 < adv[1, 2]
    # and A's first turn: both positive; C's turns: both negative
    assert episode[0, 0] > 0 and adv[0, 0] > 0
    assert bool((adv[2][G_MASK[2].bool()] < 0).all())


def test_gigpo_step_groups_stay_inside_their_group() -> None:
    # Move D into group 7: its keys now pool with A, B, C. s1 has 3 members A1 1, B2 0.4, D1 1: mean 0.8,
    # dev [0.2, -0.4, 0.2] (mean-only), so D's step advantage is no longer 0; s2 is unchanged ([2/15, -1/15]).
    returns = turn_discounted_returns(G_TURN_REWARDS, G_TURN_MASK, gamma=0.5)
    step = anchor_state_advantages(returns, G_TURN_MASK, T([7, 7, 7, 7]), G_KEYS, normalize_std=False)
    close(step[:, 1], [0.2, 2 / 15, -1 / 15, 0.2])
    close(step[[0, 1, 3], [1, 2, 1]], [0.2, -0.4, 0.2])


def test_gigpo_ignores_padding_values() -> None:
    # NaN turn rewards / None keys on padding turns and a fully masked extra row change nothing for the others.
    extra = dict(
        ep=torch.cat([G_EPISODE, T([NAN])]),
        tr=torch.cat([G_TURN_REWARDS, T([[NAN, NAN, NAN]])]),
        tm=torch.cat([G_TURN_MASK, T([[1, 0, 0]])]),  # a "valid" turn on a row without tokens is absent too
        g=torch.cat([G_GROUPS, T([7])]),
        ids=torch.cat([G_TURN_IDS, torch.full((1, 8), -1)]),
    )
    mask = (extra["ids"] >= 0).long()
    adv = gigpo_advantages(
        extra["ep"], extra["tr"], extra["tm"], extra["g"], [*G_KEYS, ["s0"]], extra["ids"], mask, gamma=0.5, eps=0.0
    )
    close(adv, [*gigpo_by_hand([*EP_7, 0.0], STEP, 1.0), [0.0] * 8])


# ---------------------------------------------------------------- validation
def test_check_trajectory_batch_accepts_a_valid_batch() -> None:
    check_trajectory_batch(
        G_MASK,
        G_TURN_IDS,
        turn_mask=G_TURN_MASK,
        turn_rewards=G_TURN_REWARDS,
        episode_rewards=G_EPISODE,
        group_ids=G_GROUPS,
        state_keys=G_KEYS,
        num_turns=3,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mask": T([[2, 0]]), "turn_ids": T([[0, -1]])}, "only 0 and 1"),
        ({"mask": T([[1, 1]]), "turn_ids": T([[0, -1]])}, r"exactly where mask is 1: at \(row 0, token 1\)"),
        ({"mask": T([[1, 0]]), "turn_ids": T([[0, 0]])}, r"exactly where mask is 1: at \(row 0, token 1\)"),
        ({"mask": T([[1, 1]]), "turn_ids": T([[0.0, 1.0]])}, "integer"),
        ({"mask": T([[1, 1]]), "turn_ids": T([[0, 1, 1]])}, "like mask"),
        ({"mask": T([1, 1]), "turn_ids": T([0, 1])}, r"mask must be \(B, T\)"),
        ({"turn_mask": T([[1, 1]]), "num_turns": 3}, "number of turns K disagrees"),
        ({"turn_mask": T([[1]])}, "turn index 1 .* out of range for K = 1"),
        ({"turn_mask": T([[1, 0]])}, "belongs to turn 1, whose turn_mask is 0"),
        ({"turn_rewards": T([1.0, 2.0])}, r"turn_rewards must be \(B, K\)"),
        ({"episode_rewards": T([1.0, 2.0])}, r"episode_rewards must be \(B,\)"),
        ({"group_ids": T([0, 0])}, r"group_ids must be \(B,\)"),
        ({"group_ids": T([0.5])}, "group_ids must be an integer"),
        ({"turn_mask": T([[1, 1]]), "state_keys": [["a", "b"], ["c"]]}, "B = 1 rows"),
        ({"turn_mask": T([[1, 1]]), "state_keys": [["a"]]}, r"state_keys\[0\]\[1\] is missing"),
        ({"turn_mask": T([[1, 1]]), "state_keys": [["a", "b", "c"]]}, "more than K = 2"),
        ({"turn_mask": T([[1, 1]]), "state_keys": [["a", ["b"]]]}, "not hashable"),
        ({"state_keys": [["a", "b"]]}, "needs turn_mask"),
    ],
)
def test_check_trajectory_batch_errors(kwargs: dict, match: str) -> None:
    args = {"mask": T([[1, 0, 1]]), "turn_ids": T([[0, -1, 1]])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        check_trajectory_batch(args.pop("mask"), args.pop("turn_ids"), **args)


def test_shape_errors_are_clear() -> None:
    with pytest.raises(ValueError, match=r"episode_rewards must be \(B,\)"):
        episode_group_advantages(T([1.0, 2.0]), T([0]), torch.ones(1, 3))
    with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
        episode_group_advantages(T([1.0]), T([0]), torch.ones(1, 3), estimator="ppo")
    with pytest.raises(ValueError, match=r"turn_rewards must be \(B, K\)"):
        turn_discounted_returns(torch.zeros(2, 3), torch.ones(2, 4), gamma=0.9)
    with pytest.raises(ValueError, match=r"token 1\) has turn index 2, not in \[0, 2\)"):
        turns_to_tokens(torch.zeros(1, 2), T([[0, 2]]), T([[1, 1]]))
    with pytest.raises(ValueError, match=r"state_keys\[0\]\[0\] is missing"):
        gigpo_advantages(T([1.0]), T([[1.0]]), T([[1]]), T([0]), [[None]], T([[0]]), T([[1]]), gamma=0.9)


# ---------------------------------------------------------------- properties
K = 4


def random_batch(seed: int, dtype: torch.dtype = torch.float64) -> dict:
    """Groups of 1-4 trajectories with random distinct ids, shuffled rows, 0-4 turns each (0 = all-masked row),
    observation tokens between turns, NaN rewards on padding turns and absent rows, small state-key alphabet."""
    rng = random.Random(seed)
    group_list = rng.sample(range(1000), rng.randint(1, 4))
    rows = [gid for gid in group_list for _ in range(rng.randint(1, 4))]
    rng.shuffle(rows)
    ids_rows, keys, n_turns = [], [], []
    for _ in rows:
        n = rng.choice([0, 1, 2, 3, 4, 4])
        row: list[int] = []
        for k in range(n):
            row += [-1] * rng.randint(0, 2) + [k] * rng.randint(1, 3)
        ids_rows.append(row + [-1] * rng.randint(0, 2))
        keys.append([rng.randint(0, 2) for _ in range(n)])
        n_turns.append(n)
    width = max(len(r) for r in ids_rows)
    turn_ids = T([r + [-1] * (width - len(r)) for r in ids_rows], dtype=torch.long)  # (B, 0) stays integer
    turn_mask = T([[int(k < n) for k in range(K)] for n in n_turns])
    turn_rewards = T([[rng.uniform(-2, 2) if k < n else NAN for k in range(K)] for n in n_turns], dtype=dtype)
    episode = T([rng.choice([0.0, 1.0, rng.uniform(-3, 3)]) if n else NAN for n in n_turns], dtype=dtype)
    return {
        "episode_rewards": episode,
        "turn_rewards": turn_rewards,
        "turn_mask": turn_mask,
        "group_ids": T(rows),
        "state_keys": keys,
        "turn_ids": turn_ids,
        "mask": (turn_ids >= 0).long(),
    }


def gigpo(batch: dict, **kw) -> torch.Tensor:
    return gigpo_advantages(**batch, gamma=kw.pop("gamma", 0.9), **kw)


def groups_of(batch: dict) -> dict[int, list[int]]:
    """Present rows (with >= 1 assistant token) by group id."""
    out: dict[int, list[int]] = {}
    for b, (g, present) in enumerate(zip(batch["group_ids"].tolist(), batch["mask"].any(-1).tolist())):
        if present:
            out.setdefault(g, []).append(b)
    return out


def seq_value(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-row value of an advantage broadcast on the row's tokens (0 for all-masked rows)."""
    return adv.sum(-1) / mask.sum(-1).clamp_min(1)


seeds = st.integers(0, 100_000)


@given(seed=seeds)
@settings(max_examples=80, deadline=None)
def test_random_batches_are_valid_and_shapes(seed: int) -> None:
    b = random_batch(seed)
    check_trajectory_batch(
        b["mask"],
        b["turn_ids"],
        turn_mask=b["turn_mask"],
        turn_rewards=b["turn_rewards"],
        episode_rewards=b["episode_rewards"],
        group_ids=b["group_ids"],
        state_keys=b["state_keys"],
    )
    shape = b["mask"].shape
    for est in EPISODE_ESTIMATORS:
        assert episode_group_advantages(b["episode_rewards"], b["group_ids"], b["mask"], estimator=est).shape == shape
    assert reinforce_pp_trajectories(b["episode_rewards"], b["mask"]).shape == shape
    assert turn_discounted_returns(b["turn_rewards"], b["turn_mask"], gamma=0.9).shape == b["turn_mask"].shape
    assert gigpo(b).shape == shape
    assert gigpo(b).dtype == torch.float64


@given(seed=seeds)
@settings(max_examples=80, deadline=None)
def test_episode_advantages_sum_to_zero_per_group(seed: int) -> None:
    b = random_batch(seed)
    for est in EPISODE_ESTIMATORS:  # GRPO and Dr.GRPO by construction, RLOO = n/(n-1) * Dr.GRPO
        seq = seq_value(
            episode_group_advantages(b["episode_rewards"], b["group_ids"], b["mask"], estimator=est), b["mask"]
        )
        for rows in groups_of(b).values():
            assert abs(float(seq[rows].sum())) < 1e-9, est


@given(seed=seeds)
@settings(max_examples=80, deadline=None)
def test_rloo_and_grpo_equal_the_hand_formulas(seed: int) -> None:
    b = random_batch(seed)
    r = b["episode_rewards"].tolist()
    rloo = seq_value(
        episode_group_advantages(b["episode_rewards"], b["group_ids"], b["mask"], estimator="rloo"), b["mask"]
    )
    grpo = seq_value(episode_group_advantages(b["episode_rewards"], b["group_ids"], b["mask"], eps=0.0), b["mask"])
    for rows in groups_of(b).values():
        n = len(rows)
        mean = sum(r[i] for i in rows) / n
        std = math.sqrt(sum((r[i] - mean) ** 2 for i in rows) / (n - 1)) if n > 1 else 0.0
        for i in rows:
            expected = r[i] - sum(r[j] for j in rows if j != i) / (n - 1) if n > 1 else 0.0
            assert math.isclose(float(rloo[i]), expected, abs_tol=1e-9)
            expected = (r[i] - mean) / std if std > 1e-9 else 0.0
            assert math.isclose(float(grpo[i]), expected, abs_tol=1e-7)


@given(seed=seeds, group_size=st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_contiguous_full_groups_match_roll_algos_advantages(seed: int, group_size: int) -> None:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(3 * group_size, generator=g, dtype=torch.float64)
    groups = torch.arange(3).repeat_interleave(group_size)
    mask = torch.ones(3 * group_size, 2)
    close(episode_group_advantages(scores, groups, mask)[:, 0], group_normalized(scores, group_size), 1e-9)
    close(episode_group_advantages(scores, groups, mask, estimator="rloo")[:, 1], leave_one_out(scores, group_size))
    dr = group_normalized(scores, group_size, std_normalize=False)
    close(episode_group_advantages(scores, groups, mask, estimator="dr_grpo")[:, 0], dr)


@given(seed=seeds)
@settings(max_examples=80, deadline=None)
def test_everything_finite_and_zero_off_mask(seed: int) -> None:
    # random_batch puts NaN rewards on padding turns and on all-masked rows
    b = random_batch(seed)
    off = ~b["mask"].bool()
    outs = [
        *(
            episode_group_advantages(b["episode_rewards"], b["group_ids"], b["mask"], estimator=e)
            for e in EPISODE_ESTIMATORS
        ),
        reinforce_pp_trajectories(b["episode_rewards"], b["mask"]),
        reinforce_pp_trajectories(b["episode_rewards"], b["mask"], group_ids=b["group_ids"]),
        gigpo(b),
        gigpo(b, normalize_std=False, step_weight=0.3),
    ]
    for out in outs:
        assert torch.isfinite(out).all()
        assert bool((out[off] == 0).all())
    returns = turn_discounted_returns(b["turn_rewards"], b["turn_mask"], gamma=0.9)
    assert torch.isfinite(returns).all() and bool((returns[~b["turn_mask"].bool()] == 0).all())


@given(seed=seeds, perm_seed=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_gigpo_is_invariant_to_trajectory_order(seed: int, perm_seed: int) -> None:
    b = random_batch(seed)
    perm = torch.randperm(b["mask"].shape[0], generator=torch.Generator().manual_seed(perm_seed))
    pb = {k: ([v[i] for i in perm.tolist()] if k == "state_keys" else v[perm]) for k, v in b.items()}
    torch.testing.assert_close(gigpo(pb, step_weight=0.0), gigpo(b, step_weight=0.0)[perm])  # episode part
    torch.testing.assert_close(gigpo(pb), gigpo(b)[perm])
    # and the episode part is exactly episode_group_advantages
    torch.testing.assert_close(
        gigpo(b, step_weight=0.0), episode_group_advantages(b["episode_rewards"], b["group_ids"], b["mask"])
    )


@given(seed=seeds)
@settings(max_examples=60, deadline=None)
def test_gigpo_with_unique_states_is_the_episode_advantage(seed: int) -> None:
    # every turn its own state -> every step group has one member -> A^S = 0
    b = random_batch(seed)
    b["state_keys"] = [[(i, k) for k in range(len(row))] for i, row in enumerate(b["state_keys"])]
    torch.testing.assert_close(gigpo(b), episode_group_advantages(b["episode_rewards"], b["group_ids"], b["mask"]))


@given(seed=seeds)
@settings(max_examples=60, deadline=None)
def test_step_advantages_sum_to_zero_per_step_group(seed: int) -> None:
    b = random_batch(seed)
    returns = turn_discounted_returns(b["turn_rewards"], b["turn_mask"], gamma=0.8)
    for normalize_std in (True, False):
        step = anchor_state_advantages(
            returns, b["turn_mask"], b["group_ids"], b["state_keys"], normalize_std=normalize_std
        )
        sums: dict = {}
        for i, (g, keys) in enumerate(zip(b["group_ids"].tolist(), b["state_keys"])):
            for k, key in enumerate(keys):
                sums[(g, key)] = sums.get((g, key), 0.0) + float(step[i, k])
        assert all(abs(s) < 1e-9 for s in sums.values())


@given(seed=seeds)
@settings(max_examples=40, deadline=None)
def test_fp32_matches_fp64(seed: int) -> None:
    b64, b32 = random_batch(seed), random_batch(seed, torch.float32)
    torch.testing.assert_close(gigpo(b32).double(), gigpo(b64), atol=1e-4, rtol=1e-4)
    rpp32 = reinforce_pp_trajectories(b32["episode_rewards"], b32["mask"]).double()
    torch.testing.assert_close(
        rpp32, reinforce_pp_trajectories(b64["episode_rewards"], b64["mask"]), atol=1e-4, rtol=1e-4
    )


# ---------------------------------------------------------------- per-turn rewards, group-relative (turn_grpo)
def test_turn_group_advantages_by_hand() -> None:
    # A (group 0): rewards [0, 1], gamma 0.5 -> returns [0.5, 1]; B (group 0): one turn, reward 0 (its padding turn
    # holds 99, never read) -> [0]; C (group 5): [0.5, 1] -> returns [1, 1], all equal -> 0.
    # Group 0's turn returns [0.5, 1, 0]: mean 0.5, sample std 0.5 -> advantages [0, 1, -1].
    turn_rewards = T([[0.0, 1.0], [0.0, 99.0], [0.5, 1.0]])
    turn_mask = T([[1, 1], [1, 0], [1, 1]])
    group_ids = T([0, 0, 5])
    mask = T([[1, 0, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0]])
    turn_ids = T([[0, -1, 1, 1], [0, 0, -1, -1], [0, -1, 1, -1]])
    adv = turn_group_advantages(turn_rewards, turn_mask, group_ids, turn_ids, mask, gamma=0.5, eps=0.0)
    close(adv, [[0.0, 0.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    dr = turn_group_advantages(turn_rewards, turn_mask, group_ids, turn_ids, mask, gamma=0.5, estimator="dr_grpo")
    close(dr, [[0.0, 0.0, 0.5, 0.5], [-0.5, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # gamma = 1 and one turn per trajectory: the episode-level GRPO advantage.
    one = turn_group_advantages(T([[1.0], [0.0]]), T([[1], [1]]), T([3, 3]), T([[0, 0]] * 2), T([[1, 1]] * 2))
    close(one, episode_group_advantages(T([1.0, 0.0]), T([3, 3]), T([[1, 1]] * 2), estimator="grpo"))


# ---------------------------------------------------------------- non-finite rewards of present rows
@pytest.mark.parametrize("bad", [NAN, math.inf])
def test_non_finite_rewards_that_take_part_are_errors(bad: float) -> None:
    # A NaN failed every min < max spread test: groups [1, NaN] and [1, 0] gave [0, 0, 0.7071, -0.7071] (its group
    # silently 0) and REINFORCE++ zeroed the whole batch; an inf gave NaN advantages. As roll_algos.advantages,
    # a reward that takes part must be finite; absent rows and padding turns may hold anything (tests above).
    ones = torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"episode_rewards is not finite at \(row 1\)"):
        episode_group_advantages(T([1.0, bad, 1.0, 0.0]), T([0, 0, 1, 1]), ones)
    with pytest.raises(ValueError, match=r"episode_rewards is not finite at \(row 1\)"):
        reinforce_pp_trajectories(T([1.0, bad, 1.0, 0.0]), ones)
    # a valid turn (row 0, turn 1) of trajectories that have tokens
    turn_rewards, turn_mask, turn_ids = T([[1.0, bad], [0.0, 1.0]]), torch.ones(2, 2), T([[0, 1], [0, 1]])
    with pytest.raises(ValueError, match=r"turn_rewards is not finite at \(row 0, turn 1\)"):
        turn_group_advantages(turn_rewards, turn_mask, T([0, 0]), turn_ids, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"turn_rewards is not finite at \(row 0, turn 1\)"):
        gigpo_advantages(
            T([1.0, 0.0]), turn_rewards, turn_mask, T([0, 0]), [["a", "b"]] * 2, turn_ids, torch.ones(2, 2), gamma=1.0
        )
    with pytest.raises(ValueError, match=r"turn_returns is not finite at \(row 0, turn 1\)"):
        anchor_state_advantages(turn_rewards, turn_mask, T([0, 0]), [["a", "b"]] * 2)
