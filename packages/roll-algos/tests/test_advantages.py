"""Advantage estimators: hand-computed values (arithmetic in comments) and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roll_algos.advantages import (
    batch_normalized,
    broadcast_to_tokens,
    discounted_returns,
    gae,
    group_baseline_batch_normalized,
    group_normalized,
    leave_one_out,
    reward_normalized,
    whiten,
)

T = torch.tensor


def close(a: torch.Tensor, b: list[float] | torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


# ---------------------------------------------------------------- hand-computed
def test_group_normalized_by_hand() -> None:
    # group 1: [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4*0.25/3) = sqrt(1/3) = 0.57735
    #   -> +-0.5/0.57735 = +-0.866025
    # group 2: [2, 2, 2, 2]: zero std -> 0
    adv = group_normalized(T([1.0, 0, 0, 1, 2, 2, 2, 2]), 4, eps=0.0)
    close(adv, [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0])


def test_dr_grpo_mean_only() -> None:
    # [3, 1] - mean 2 = [1, -1]; [0, 0, ...]
    close(group_normalized(T([3.0, 1, 5, 5]), 2, std_normalize=False), [1, -1, 0, 0])


def test_group_of_one_is_zero() -> None:
    close(group_normalized(T([3.0, -1.0]), 1), [0, 0])
    close(leave_one_out(T([3.0, -1.0]), 1), [0, 0])


def test_leave_one_out_by_hand() -> None:
    # [1, 2, 6]: others' means 4, 3.5, 1.5 -> [-3, -1.5, 4.5]
    close(leave_one_out(T([1.0, 2, 6]), 3), [-3, -1.5, 4.5])


def test_batch_normalized_by_hand() -> None:
    # [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1]
    close(batch_normalized(T([1.0, 2, 3]), eps=0.0), [-1, 0, 1])
    close(batch_normalized(T([5.0])), [0.0])
    close(batch_normalized(T([5.0, 5.0])), [0.0, 0.0])


def test_group_baseline_batch_normalized_by_hand() -> None:
    # groups [1, 3] and [10, 10]: centred [-1, 1, 0, 0]; batch mean 0, unbiased std sqrt(2/3)=0.816497
    close(group_baseline_batch_normalized(T([1.0, 3, 10, 10]), 2, eps=0.0), [-1.224745, 1.224745, 0, 0])


def test_gae_by_hand_with_gap() -> None:
    # One row, tokens at t=0, 2 valid; t=1 is a masked hole (skipped, not a zero-reward step).
    # r = [0, x, 1], V = [0.5, x, 0.25], gamma=0.9, lam=0.8.
    # t=2: delta = 1 + 0.9*0 - 0.25 = 0.75; A2 = 0.75
    # t=0: delta = 0 + 0.9*0.25 - 0.5 = -0.275; A0 = -0.275 + 0.9*0.8*0.75 = 0.265
    rewards = T([[0.0, float("nan"), 1.0]])
    values = T([[0.5, float("inf"), 0.25]])
    mask = T([[1, 0, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.265, 0.0, 0.75]])
    close(ret, [[0.765, 0.0, 1.0]])


def test_discounted_returns_by_hand() -> None:
    # r = [1, 0, 2] with gamma 0.5: G2 = 2, G1 = 0 + 1 = 1, G0 = 1 + 0.5 = 1.5; a padded tail stays 0.
    out = discounted_returns(T([[1.0, 0, 2, 7]]), T([[1, 1, 1, 0]]), gamma=0.5)
    close(out, [[1.5, 1.0, 2.0, 0.0]])


def test_whiten_by_hand() -> None:
    # valid [1, 3]: mean 2, unbiased var 2 -> [-1/sqrt2, 1/sqrt2]; masked -> 0
    out = whiten(T([1.0, 99.0, 3.0]), T([1, 0, 1]), eps=0.0)
    close(out, [-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)])
    # shift_mean=False adds the mean back
    close(whiten(T([1.0, 3.0]), T([1, 1]), eps=0.0, shift_mean=False), [2 - 1 / math.sqrt(2), 2 + 1 / math.sqrt(2)])
    # fewer than two valid: unchanged
    close(whiten(T([4.0, 5.0]), T([0, 1])), [0.0, 5.0])


def test_broadcast_to_tokens() -> None:
    close(broadcast_to_tokens(T([2.0, -1.0]), T([[1, 1, 0], [0, 1, 1]])), [[2, 2, 0], [0, -1, -1]])


def test_shape_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="does not split into groups of 3"):
        group_normalized(T([1.0, 2.0]), 3)
    with pytest.raises(ValueError, match="1-D"):
        leave_one_out(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match=r"must be \(B, T\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1, lam=1)


# ---------------------------------------------------------------- properties
scores_st = st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=2, max_size=8)


@given(groups=st.lists(scores_st.filter(lambda s: len(s) == 4), min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_group_normalized_zero_mean_per_group(groups: list[list[float]]) -> None:
    scores = T([x for g in groups for x in g], dtype=torch.float64)
    adv = group_normalized(scores, 4).view(-1, 4)
    assert torch.allclose(adv.sum(-1), torch.zeros(len(groups), dtype=torch.float64), atol=1e-9)
    assert torch.isfinite(adv).all()


@given(groups=st.lists(scores_st.filter(lambda s: len(s) == 3), min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_leave_one_out_sums_to_zero(groups: list[list[float]]) -> None:
    scores = T([x for g in groups for x in g], dtype=torch.float64)
    assert torch.allclose(leave_one_out(scores, 3).view(-1, 3).sum(-1), torch.zeros(len(groups), dtype=torch.float64))


def _random_tokens(seed: int, b: int = 3, t: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.3).to(torch.float64)
    return rewards, values, mask


@given(seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_values(seed: int) -> None:
    rewards, values, mask = _random_tokens(seed)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    expected = discounted_returns(rewards, mask, gamma=1.0) - values * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, discounted_returns(rewards, mask, gamma=1.0))


@given(seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_masked_values_change_nothing(seed: int) -> None:
    rewards, values, mask = _random_tokens(seed)
    noise = torch.full_like(rewards, float("nan"))
    r2 = torch.where(mask.bool(), rewards, noise)
    v2 = torch.where(mask.bool(), values, -noise)
    for fn in (
        lambda r, v: gae(r, v, mask, gamma=0.95, lam=0.9)[0],
        lambda r, v: discounted_returns(r, mask, gamma=0.9),
        lambda r, v: whiten(r, mask),
    ):
        torch.testing.assert_close(fn(rewards, values), fn(r2, v2))


@given(seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_fp32_matches_fp64(seed: int) -> None:
    rewards, values, mask = _random_tokens(seed)
    scores = rewards[:, 0].repeat(2)  # 6 scores, groups of 3
    for fn in (
        lambda s: group_normalized(s, 3),
        lambda s: leave_one_out(s, 3),
        lambda s: batch_normalized(s),
        lambda s: group_baseline_batch_normalized(s, 3),
    ):
        torch.testing.assert_close(fn(scores.float()).double(), fn(scores), atol=1e-4, rtol=1e-4)
    a64, _ = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    a32, _ = gae(rewards.float(), values.float(), mask.float(), gamma=0.99, lam=0.95)
    torch.testing.assert_close(a32.double(), a64, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("value", [0.1, 0.3, 0.9, 1.0 / 3.0])
@pytest.mark.parametrize("group_size", [5, 8, 12])
def test_an_all_equal_group_alone_in_its_batch_gets_exactly_zero(value: float, group_size: int) -> None:
    """In float32 the mean of G copies of 0.9 can be an ulp off, so a `std > 0` test let (x - mean) / (std + eps)
    through: a few hundredths of advantage, one sign for the whole group (rollout_batch_size=1 runs)."""
    scores = torch.full((group_size,), value, dtype=torch.float32)
    for adv in (
        group_normalized(scores, group_size),
        group_normalized(scores, group_size, std_normalize=False),
        leave_one_out(scores, group_size),
        batch_normalized(scores),
        *(reward_normalized(scores, group_size, mean_type=m, std_type=s) for m in ("group", "batch") for s in NTS),
    ):
        assert torch.equal(adv, torch.zeros_like(scores))


NTS = ("group", "batch", "none")


# ---------------------------------------------------------------- review fixes
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_score_is_an_error_not_a_silent_zero(bad: float) -> None:
    """A NaN score made its group (group_normalized, leave_one_out) or the whole batch (batch_normalized) all-zero
    without a word, since amax/amin pass NaN and NaN > x is False; an inf gave -inf/NaN advantages under Dr.GRPO and
    RLOO. Scores are checked instead, naming the rows."""
    scores = T([1.0, 0.0, 1.0, 0.0, 1.0, bad, 0.0, 1.0])
    calls = [
        lambda: group_normalized(scores, 4),
        lambda: group_normalized(scores, 4, std_normalize=False),
        lambda: leave_one_out(scores, 4),
        lambda: batch_normalized(scores),
        lambda: group_baseline_batch_normalized(scores, 4),
        *(lambda m=m, s=s: reward_normalized(scores, 4, mean_type=m, std_type=s) for m in NTS for s in NTS),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"not finite.*\[5\]"):
            call()


@pytest.mark.parametrize("value", [0.9, 0.7, 0.1])
def test_whiten_of_equal_values_is_exactly_zero(value: float) -> None:
    """reinforce_pp whitens the returns over the batch's tokens: a batch whose rows all scored 0.9 (gamma 1, no KL)
    has equal returns, and the float mean of 32768 copies of 0.9 is ulps off, times rsqrt(0 + 1e-8) = 1e4: advantages
    of ~3e-3 instead of 0 (as the all-equal groups of group_normalized before)."""
    returns = torch.full((64, 512), value)
    mask = torch.ones(64, 512)
    mask[3, 100:] = 0
    assert torch.equal(whiten(returns, mask), torch.zeros_like(returns))
    assert torch.equal(whiten(returns, mask, shift_mean=False), returns * mask)
