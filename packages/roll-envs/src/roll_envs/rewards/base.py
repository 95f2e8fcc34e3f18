"""The reward interface: score many responses at once; failures are counted, never silent.

Contract: `score(responses, answers)` returns one `RewardResult` with a score per response, a 0/1 `correct` flag
per response (the task's strict notion of correctness, used for accuracy metrics), and counters of failures
(timeouts, crashes) so that a reward worker that silently returns zeros is visible in the metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

from roll_core.interfaces import RewardResult

__all__ = ["Reward", "RewardResult"]


class Reward:
    """Base class of rewards (structurally a `roll_core.interfaces.Reward`)."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        """Score `responses[i]` against ground truth `answers[i]`."""
        raise NotImplementedError
