"""Toy multi-turn environments for tests (referenced as env=py:agentic_toy:<Class>)."""

from __future__ import annotations

import time
from typing import Any

#: Config overrides for an agentic run of the tiny model on `SayDigit` (callers add the algorithm and run knobs).
SAY_DIGIT_OVERRIDES = (
    "model=tiny",
    "pipeline=agentic",
    "env=agentic",
    "env.env=py:agentic_toy:SayDigit",
    "env.max_turns=2",
    "env.max_tokens_per_turn=6",
    "env.max_context_length=256",
)


class SayDigit:
    """Two turns; each asks for the digit 7 and pays 0.5 when the reply ends with it. A random tiny model learns
    this within a few GRPO steps, which makes "multi-turn learning happens" testable in seconds."""

    def __init__(self, turns: int = 2, digit: str = "7") -> None:
        self.turns, self.digit, self.turn = turns, digit, 0

    def instructions(self) -> str:
        return f"Reply with the digit {self.digit}."

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        return f"Turn 1 of {self.turns}: say {self.digit}", {"state": "turn-0"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        ok = action.strip().endswith(self.digit)
        self.turn += 1
        done = self.turn >= self.turns
        info = {"state": f"turn-{self.turn}", "success": done and ok, "invalid_action": not action.strip()}
        return f"Turn {self.turn + 1} of {self.turns}: say {self.digit}", 0.5 * ok, done, False, info


class Flaky(SayDigit):
    """Steps raise for even seeds and hang (5 s) for odd ones: the env manager's two failure paths."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = seed or 0
        return super().reset(seed)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.seed % 2 == 0:
            raise RuntimeError("environment bug")
        time.sleep(5)
        return super().step(action)
