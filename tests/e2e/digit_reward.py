"""A reward a random tiny model scores on now and then, for evaluation tests
(env/reward=custom env.reward._target_=digit_reward.LastDigitReward).

The graded answer is the response's last digit (`extract_answer`); correct when it equals the row's one-digit
answer; formatted when the response holds a digit at all; score = correct + 0.1 x formatted. A random tiny model
writes digits often enough that pass@k, maj@n and their breakdowns are non-trivial numbers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from roll_envs.rewards.base import Reward, RewardResult

_DIGIT = re.compile(r"\d")


class LastDigitReward(Reward):
    """Last digit of the response against the answer (see the module docstring)."""

    def extract_answer(self, response: str) -> str | None:
        found = _DIGIT.findall(response)
        return found[-1] if found else None

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        got = [self.extract_answer(r) for r in responses]
        correct = [float(g is not None and g == str(a).strip()) for g, a in zip(got, answers)]
        formatted = [float(g is not None) for g in got]
        return RewardResult(
            scores=[c + 0.1 * f for c, f in zip(correct, formatted)], correct=correct, formatted=formatted
        )


class BrokenReward(LastDigitReward):
    """Raises on every batch: a run scored by it stops after pipeline.max_reward_failure_steps steps."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        raise RuntimeError("the reward service is down")


class OddAnswersFail(LastDigitReward):
    """Raises on any row whose answer ends in an odd digit (the guard's row-by-row pass then fails those rows only)."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        if any(str(a).strip()[-1:] in "13579" for a in answers):
            raise RuntimeError("cannot verify odd answers")
        return super().score(responses, answers)
