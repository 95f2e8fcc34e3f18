"""A reward with a constant offset, for learning tests (env.reward._target_=shifted_reward.ShiftedMathReward).

A correct estimator is blind to a constant added to every reward: GRPO's group normalisation removes it exactly
(the shifted run trains as the plain one does), PPO subtracts a learned value and whitens. An estimator that
forgets its baseline is not: every sampled response then gets a positive advantage and the policy reinforces what
it already says (on the plain 0/1 task such an estimator learns too). A critic must learn the offset before its
error can fall to the rewards' own spread.
"""

from __future__ import annotations

from collections.abc import Sequence

from roll_envs.rewards.base import RewardResult
from roll_envs.rewards.math import MathReward


class ShiftedMathReward(MathReward):
    """`MathReward` plus `SHIFT` on every score (correctness flags and counters unchanged); it takes the math
    reward's config (env.reward.*), so only `_target_` changes."""

    SHIFT = 1.0

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        res = super().score(responses, answers)
        res.scores = [s + self.SHIFT for s in res.scores]
        return res
