"""Misbehaving components for the bad-input corpus (tests/e2e/test_bad_inputs_*.py), importable by name from configs
(`env.reward._target_=bad_input_helpers.AnswerFaultReward`, `env.env=py:bad_input_helpers:MalformedEnv`): the test
module puts this folder on sys.path.

Faults are keyed by the ground truth, not by the sampled text, so that a run with a fixed data file meets each of
them for certain: a random model's responses cannot be predicted, the answers of the rows it is asked about can.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from roll_envs.rewards.base import RewardResult
from roll_envs.rewards.math import MathReward


class AnswerFaultReward(MathReward):
    """The math reward, except for rows whose answer names a fault: "raise" makes the call raise, "hang" makes it
    sleep `hang_s`, "nan"/"inf" score that value, "none" returns None instead of a result, "exit" kills the
    process scoring it (the guard's forked child), "short" returns one score too few."""

    FAULTS = ("raise", "exit", "hang", "none", "short", "nan", "inf")

    def __init__(self, hang_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hang_s = hang_s
        # Imported before the reward guard forks its child: a first import of sympy (seconds) inside a row's
        # short timeout would look like a hang.
        import math_verify  # noqa: F401

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        faults = set(answers)
        if "raise" in faults:
            raise RuntimeError("a reward bug")
        if "exit" in faults:
            os._exit(3)  # only ever called in the guard's forked child (reward_isolation=process)
        if "hang" in faults:
            time.sleep(self.hang_s)
        if "none" in faults:
            return None  # type: ignore[return-value]  # the bug under test
        # The fault rows are scored as answer "0" (numbers take the reward's fast path, no symbolic parsing).
        res = super().score(responses, ["0" if a in self.FAULTS else a for a in answers])
        if "short" in faults and len(res.scores) > 1:
            res.scores = res.scores[:-1]
        bad = {"nan": float("nan"), "inf": float("inf")}
        res.scores = [bad.get(a, s) for s, a in zip(res.scores, answers)]
        return res


class MalformedEnv:
    """A two-turn environment whose step misbehaves by seed: seed % 3 == 0 returns a 3-tuple, 1 a NaN reward,
    2 the reward "lots" (not a number). Each must end its episode as a counted env_error."""

    def instructions(self) -> str:
        return "Reply with the digit 7."

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = seed or 0
        return "say 7", {}

    def step(self, action: str) -> Any:
        kind = self.seed % 3
        if kind == 0:
            return "say 7", 1.0, False  # the Gymnasium 5-tuple is missing two items
        return "say 7", float("nan") if kind == 1 else "lots", True, False, {}
