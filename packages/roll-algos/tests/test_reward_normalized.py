"""reward_normalized: ROLL's norm_mean_type x norm_std_type choices (Lite PPO = group mean, batch std), by hand.

Scores [1, 0, 1, 1 | 0, 0, 0, 1], groups of G = 4:
    group means 0.75 and 0.25; batch mean 0.5;
    group stds (unbiased): sum of squared deviations 3 * 0.25^2 + 0.75^2 = 0.75, / 3 = 0.25 -> 0.5 (both groups);
    batch std (unbiased): 8 squared deviations of 0.25 = 2, / 7 -> sqrt(2 / 7) = 0.534522.
"""

from __future__ import annotations

import math

import pytest
import torch

from roll_algos.advantages import NORM_TYPES, group_normalized, reward_normalized

SCORES = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
BATCH_STD = math.sqrt(2 / 7)
EPS = 1e-6


def norm(mean: str, std: str, scores: torch.Tensor = SCORES, g: int = 4) -> list[float]:
    return reward_normalized(scores, g, mean_type=mean, std_type=std).tolist()


def test_lite_ppo_group_mean_batch_std() -> None:
    centred = [0.25, -0.75, 0.25, 0.25, -0.25, -0.25, -0.25, 0.75]
    assert norm("group", "batch") == pytest.approx([c / (BATCH_STD + EPS) for c in centred], abs=1e-6)
    # e.g. the first: 0.25 / 0.534522 = 0.467707
    assert norm("group", "batch")[0] == pytest.approx(0.467707, abs=1e-5)


@pytest.mark.parametrize(
    ("mean", "std", "expected"),
    [
        ("group", "group", [0.5, -1.5, 0.5, 0.5, -0.5, -0.5, -0.5, 1.5]),  # (r - group mean) / 0.5: GRPO
        ("group", "none", [0.25, -0.75, 0.25, 0.25, -0.25, -0.25, -0.25, 0.75]),  # Dr.GRPO
        ("batch", "batch", [0.5 / BATCH_STD * (1 if r else -1) for r in SCORES.tolist()]),  # +-0.935414
        ("batch", "group", [1.0 if r else -1.0 for r in SCORES.tolist()]),  # (r - 0.5) / 0.5
        ("batch", "none", [0.5 if r else -0.5 for r in SCORES.tolist()]),
        ("none", "group", [2 * r for r in SCORES.tolist()]),  # r / 0.5
        ("none", "none", SCORES.tolist()),
    ],
)
def test_every_choice(mean: str, std: str, expected: list[float]) -> None:
    assert norm(mean, std) == pytest.approx(expected, abs=1e-5)


def test_group_group_is_grpo_exactly() -> None:
    scores = torch.tensor([0.3, 0.9, 0.1, 0.4, 1.0, 1.0, 1.0, 1.0])
    assert torch.equal(reward_normalized(scores, 4), group_normalized(scores, 4))


def test_a_zero_or_undefined_divisor_gives_zero() -> None:
    ones = torch.ones(4)
    assert norm("group", "batch", ones, 2) == [0.0] * 4  # batch std 0
    assert norm("none", "group", ones, 2) == [0.0] * 4  # group std 0: 0, not 1 / eps
    assert norm("batch", "group", torch.tensor([1.0, 0.0, 1.0]), 1) == [0.0] * 3  # group of one: std undefined
    assert norm("group", "batch", torch.tensor([1.0]), 1) == [0.0]  # batch of one
    # groups of one under group mean are 0 whatever the std.
    assert norm("group", "none", torch.tensor([1.0, 0.0]), 1) == [0.0, 0.0]


def test_bad_choices_are_errors() -> None:
    assert NORM_TYPES == ("group", "batch", "none")
    with pytest.raises(ValueError, match="mean_type='running'"):
        reward_normalized(SCORES, 4, mean_type="running")
    with pytest.raises(ValueError, match="std_type=None"):
        reward_normalized(SCORES, 4, std_type=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not split into groups of 3"):
        reward_normalized(SCORES, 3, mean_type="batch", std_type="batch")
