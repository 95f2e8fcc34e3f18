"""A multi-domain reward given a row whose domain has no reward (a row from outside the task, or metadata naming
no domain): the row scored 0 and counted in `unknown_domain` only, unflagged and unlogged, so it read as a wrong
answer (in reward/accuracy and eval/accuracy) where nothing was graded. It is a failed row now, logged once."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from roll_core.cluster.reward_guard import GuardedReward
from roll_envs.rewards.base import Reward, RewardResult
from roll_envs.tasks.multi import DomainReward


class Exact(Reward):
    """1 for a response equal to its answer."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        s = [float(r == a) for r, a in zip(responses, answers)]
        return RewardResult(s, s, [1.0] * len(s), {})


def test_a_row_without_a_domain_reward_is_a_failed_logged_row(caplog: pytest.LogCaptureFixture) -> None:
    reward = DomainReward({"a": Exact()})
    meta = [{"domain": "a"}, {"domain": "zzz"}, {"domain": "a"}, {}]
    with caplog.at_level("WARNING", logger="roll_envs.tasks.multi"):
        res = reward.score(["1", "1", "2", "1"], ["1", "1", "1", "1"], metadata=meta)
    assert res.scores == [1.0, 0.0, 0.0, 0.0]
    # Row 2 is a wrong answer of domain a (graded); rows 1 and 3 were never graded: failed, not wrong.
    assert res.failed == [False, True, False, True]
    assert res.counters["unknown_domain"] == 2
    warned = [r.getMessage() for r in caplog.records if r.name == "roll_envs.tasks.multi"]
    assert len(warned) == 1 and "2 of 4 rows" in warned[0] and "'zzz': 1, None: 1" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="roll_envs.tasks.multi"):  # the same domains again: counted, not logged
        again = reward.score(["1"], ["1"], metadata=[{"domain": "zzz"}])
    assert again.failed == [True] and again.counters["unknown_domain"] == 1
    assert not [r for r in caplog.records if r.name == "roll_envs.tasks.multi"]


def test_the_guard_counts_a_row_without_a_domain_reward_as_unscored() -> None:
    """What the run logs (reward/failed_rows, reward/failed_unscored) and what evaluation reads (`failed`)."""
    guarded = GuardedReward(DomainReward({"a": Exact()}), name="multi", isolation="inline")
    out = guarded.score(["1", "1", "0"], ["1", "1", "1"], metadata=[{"domain": "a"}, {"domain": "b"}, {"domain": "a"}])
    assert out.scores == [1.0, 0.0, 0.0] and out.failed == [False, True, False]
    assert (out.counters["failed_rows"], out.counters["failed_unscored"], out.counters["unknown_domain"]) == (1, 1, 1)
    assert guarded.last_failure is not None and "1 of 3 rows" in guarded.last_failure
