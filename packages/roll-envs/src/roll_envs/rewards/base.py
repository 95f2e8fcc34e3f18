"""The reward interface: score many responses at once; failures are counted, never silent.

Contract: `score(responses, answers)` returns one `RewardResult` with a score per response, a 0/1 `correct` flag
per response (the task's strict notion of correctness, used for accuracy metrics), and counters of failures
(timeouts, crashes) so that a reward worker that silently returns zeros is visible in the metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RewardResult:
    """Scores of one batch. `scores[i]` and `correct[i]` belong to response i."""

    scores: list[float]
    correct: list[float]
    formatted: list[float]
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (len(self.scores) == len(self.correct) == len(self.formatted)):
            raise ValueError("scores, correct and formatted must have one entry per response")


class Reward:
    """Base class of rewards."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        """Score `responses[i]` against ground truth `answers[i]`."""
        raise NotImplementedError
