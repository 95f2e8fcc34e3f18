"""An out-of-tree multi-turn environment (entry point `roll.agentic_envs: dummy_echo`): repeat the shown word."""

from __future__ import annotations

import random
from typing import Any

WORDS = ("apple", "river", "stone", "cloud", "ember", "maple", "orbit", "quilt")


class EchoEnv:
    """Each turn shows a word; replying it (in \\boxed{} or as the last line) scores 1; three in a row win."""

    max_steps = 6
    invalid_penalty = -0.1

    def __init__(self, rounds: int = 3) -> None:
        self.rounds, self.word, self.done, self.steps, self.streak = rounds, "", False, 0, 0
        self._rng = random.Random(0)

    def instructions(self) -> str:
        return "Repeat the word I show you, e.g. \\boxed{apple}. Three correct answers win."

    def _info(self, success: bool = False, invalid: bool = False) -> dict[str, Any]:
        return {"success": success, "state": f"{self.word}:{self.streak}", "invalid_action": invalid}

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._rng = random.Random(seed)
        self.word, self.done, self.steps, self.streak = self._rng.choice(WORDS), False, 0, 0
        return f"Word: {self.word}", self._info()

    def expert_reply(self) -> str:
        return f"\\boxed{{{self.word}}}"

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.done:
            return "The episode is over.", 0.0, self.streak >= self.rounds, self.streak < self.rounds, self._info()
        self.steps += 1
        text = str(action).strip().splitlines()[-1] if str(action).strip() else ""
        text = text.removeprefix("\\boxed{").removesuffix("}").strip()
        truncated = self.steps >= self.max_steps
        if text not in WORDS:
            self.done = truncated
            return (
                f"Not a word I know. Word: {self.word}",
                self.invalid_penalty,
                False,
                truncated,
                self._info(invalid=True),
            )
        if text != self.word:
            self.done = truncated
            return f"No. Word: {self.word}", 0.0, False, truncated, self._info()
        self.streak += 1
        if self.streak >= self.rounds:
            self.done = True
            return "All correct!", 1.0, True, False, self._info(success=True)
        self.word = self._rng.choice(WORDS)
        self.done = truncated
        return f"Yes. Word: {self.word}", 0.0, False, truncated, self._info()
