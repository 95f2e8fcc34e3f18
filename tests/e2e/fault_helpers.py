"""Faulty components for the fault-tolerance tests (imported by Ray workers through the test fixture's PYTHONPATH:
`env.reward._target_=fault_helpers.FaultyReward`).

`FaultyReward` misbehaves on a fixed share of responses, chosen by a stable hash of the response text (the same in
every process, so a row fails the same way in the batch call and when it is rescored alone): it raises on ~1/8,
returns NaN on ~1/8 and hangs on ~1/16 of them; the others get the math reward's score.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence

from roll_envs.rewards.base import RewardResult
from roll_envs.rewards.math import MathReward


def fault_of(response: str) -> str:
    """How FaultyReward treats this response: "raise", "nan", "hang" or "ok"."""
    h = zlib.crc32(response.encode()) % 16
    return {0: "raise", 1: "raise", 2: "nan", 3: "nan", 4: "hang"}.get(h, "ok")


class FaultyReward(MathReward):
    """The math reward, except on the responses `fault_of` picks (`faults`: which kinds are active)."""

    def __init__(self, faults: Sequence[str] = ("raise", "nan", "hang"), hang_s: float = 60.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.faults, self.hang_s = tuple(faults), hang_s

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        kinds = [fault_of(r) for r in responses]
        if "raise" in self.faults and "raise" in kinds:
            raise RuntimeError("a reward bug")
        if "hang" in self.faults and "hang" in kinds:
            time.sleep(self.hang_s)
        res = super().score(responses, answers)
        if "nan" in self.faults:
            res.scores = [float("nan") if k == "nan" else s for s, k in zip(res.scores, kinds)]
        return res
