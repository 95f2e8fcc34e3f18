"""AsyPPO's critic shards, ensemble value and the two disagreement masks, against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from roll_algos.asyppo import agreement_mask, asyppo_masks, critic_shards, disagreement_mask, ensemble_values

NAN = float("nan")


def test_shards_deal_every_groups_responses_round_robin() -> None:
    contiguous = torch.arange(8) // 4  # two prompts, four responses each
    assert critic_shards(contiguous, 2).tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert critic_shards(contiguous, 4).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # Trajectory groups need not be contiguous: the rank within the group counts, not the row.
    assert critic_shards(torch.tensor([5, 7, 5, 7, 5, 7]), 2).tolist() == [0, 0, 1, 1, 0, 0]
    assert critic_shards(contiguous, 1).tolist() == [0] * 8
    with pytest.raises(ValueError, match="num_critics=0"):
        critic_shards(contiguous, 0)


def test_ensemble_mean_and_population_std_ignore_padding() -> None:
    values = torch.tensor([[[1.0, 3.0, NAN]], [[3.0, 3.0, 100.0]]])  # (M=2, B=1, T=3)
    mask = torch.tensor([[1, 1, 0]])
    mean, std = ensemble_values(values, mask)
    assert mean.tolist() == [[2.0, 3.0, 0.0]]
    assert std.tolist() == [[1.0, 0.0, 0.0]]  # |V1 - V2| / 2, not the unbiased |V1 - V2| / sqrt(2)
    three = torch.tensor([[[0.0]], [[3.0]], [[6.0]]])
    mean, std = ensemble_values(three, torch.ones(1, 1))
    assert (mean.item(), std.item()) == pytest.approx((3.0, math.sqrt(6.0)))
    _, std = ensemble_values(three[:1], torch.ones(1, 1))
    assert std.item() == 0.0


def test_agreement_mask_drops_the_lowest_share_of_valid_tokens() -> None:
    # Ten valid tokens with std 0.1..1.0 (shuffled over two rows) and two padded ones of std 0 that must not count.
    std = torch.tensor([[0.5, 0.1, 0.9, 0.3, 0.0, 0.7], [0.2, 1.0, 0.4, 0.8, 0.6, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0]])
    keep = agreement_mask(std, mask, 0.2)  # floor(0.2 * 10) = 2 tokens: 0.1 and 0.2
    assert keep.tolist() == [[1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0]]
    assert agreement_mask(std, mask, 0.0).tolist() == mask.float().tolist()
    assert agreement_mask(std, mask, 0.35).sum().item() == 7  # floor(3.5) = 3 masked of 10


def test_disagreement_mask_drops_the_highest_share_of_valid_tokens() -> None:
    std = torch.tensor([[0.5, 0.1, 0.9, 0.3, 9.0, 0.7], [0.2, 1.0, 0.4, 0.8, 0.6, 9.0]])  # padding is the largest
    mask = torch.tensor([[1, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0]])
    keep = disagreement_mask(std, mask, 0.2)  # 1.0 and 0.9
    assert keep.tolist() == [[1, 1, 0, 1, 0, 1], [1, 0, 1, 1, 1, 0]]
    assert disagreement_mask(std, mask, 0.0).tolist() == mask.float().tolist()


def test_ties_at_the_threshold_are_never_split_by_position() -> None:
    mask = torch.ones(1, 4)
    tied = torch.tensor([[0.1, 0.2, 0.2, 0.3]])
    assert agreement_mask(tied, mask, 0.5).tolist() == [[0, 1, 1, 1]]  # n = 2, but the 2nd and 3rd tie: one masked
    assert disagreement_mask(tied, mask, 0.5).tolist() == [[1, 1, 1, 0]]
    same = torch.zeros(1, 4)  # identical critics: no ranking, nothing masked
    assert agreement_mask(same, mask, 0.5).tolist() == [[1, 1, 1, 1]]
    assert disagreement_mask(same, mask, 0.5).tolist() == [[1, 1, 1, 1]]


@pytest.mark.parametrize("fraction", [1.0, -0.1, NAN])
def test_fractions_outside_zero_one_are_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="must lie in"):
        agreement_mask(torch.zeros(1, 2), torch.ones(1, 2), fraction)
    with pytest.raises(ValueError, match="must lie in"):
        disagreement_mask(torch.zeros(1, 2), torch.ones(1, 2), fraction)


def test_asyppo_masks_combines_and_reports_fractions() -> None:
    # Critic 2 differs from critic 1 by 0, 2, 4, 6, 8 on five valid tokens: std 0, 1, 2, 3, 4 (mean 2).
    v1 = torch.zeros(1, 6)
    v2 = torch.tensor([[0.0, 2.0, 4.0, 6.0, 8.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    m = asyppo_masks(torch.stack([v1, v2]), mask, agree_fraction=0.2, disagree_fraction=0.4)
    assert m.values.tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 0.0]]
    assert m.advantage_mask.tolist() == [[0, 1, 1, 1, 1, 0]]
    assert m.entropy_mask.tolist() == [[1, 1, 1, 0, 0, 0]]
    assert m.stats == pytest.approx(
        {"ensemble_std_mean": 2.0, "advantage_masked_fraction": 0.2, "entropy_masked_fraction": 0.4}
    )
