"""Guess the number: find a hidden integer in [low, high] with "higher"/"lower" hints.

The hidden number is drawn from the reset seed. A guess is an integer (e.g. `\\boxed{10}`; a comma only as a
thousands separator between groups of three digits, `1,000`: `1,5` is no guess, never 15); a guess outside
[low, high] or anything else is invalid (nothing changes, `invalid_penalty`). Each valid guess gets a hint: "higher"
(the number is greater than the guess) or "lower". A correct guess ends the episode with reward 1 (success);
otherwise the reward is 0 and the episode is truncated after `max_turns` steps (valid or not).
Every instance is solvable: the constructor refuses a `max_turns` below the number of guesses binary search needs
in the worst case (floor(log2(high - low + 1)) + 1).
The state key is the interval the hints so far leave possible (not the wording of the observation).
"""

from __future__ import annotations

import random
import re
from typing import ClassVar

from roll_envs.agentic.base import IllegalAction, Outcome, TextEnv

# Commas only between groups of three digits: stripping every comma read `1,5` (a decimal comma, or two guesses)
# as the guess 15.
_INTEGER = re.compile(r"[+-]?(?:\d{1,18}|\d{1,3}(?:,\d{3}){1,5})")


def binary_search_turns(low: int, high: int) -> int:
    """Guesses binary search needs in the worst case to find a number in [low, high]."""
    return (high - low + 1).bit_length()


class GuessNumberEnv(TextEnv):
    """Guess the number with higher/lower hints; see the module docstring."""

    name: ClassVar[str] = "guess_number"

    def __init__(
        self,
        low: int = 1,
        high: int = 20,
        max_turns: int = 6,
        invalid_penalty: float = -0.1,
        seed: int | None = None,
    ) -> None:
        super().__init__(max_steps=max_turns, invalid_penalty=invalid_penalty, seed=seed)
        if high < low:
            raise ValueError(f"need low <= high, got {low}, {high}")
        if max_turns < binary_search_turns(low, high):
            raise ValueError(
                f"max_turns={max_turns} cannot always find a number in [{low}, {high}]: binary search needs "
                f"{binary_search_turns(low, high)}"
            )
        self.low, self.high = low, high
        self.target = low
        self.lo, self.hi = low, high  # the interval the hints leave possible
        self.guesses: list[int] = []

    def _new_episode(self, rng: random.Random) -> None:
        self.target = rng.randint(self.low, self.high)
        self.lo, self.hi = self.low, self.high
        self.guesses = []

    def _state_key(self) -> str:
        return f"number in [{self.lo}, {self.hi}]"

    def board_key(self) -> str:
        """The episode's board: its hidden number (the state the model sees starts alike for every episode)."""
        return str(self.target)

    def _render(self) -> str:
        left = self.max_steps - self.steps
        if not self.guesses:
            return (
                f"I am thinking of an integer between {self.low} and {self.high} (inclusive). "
                f"You have {left} turns. Make your first guess."
            )
        return f"From the hints, the number is between {self.lo} and {self.hi}. Turns left: {left}."

    def _parse(self, action: str) -> int | None:
        text = action.strip()
        return int(text.replace(",", "")) if _INTEGER.fullmatch(text) else None

    def _apply(self, guess: int) -> Outcome:
        if not self.low <= guess <= self.high:
            raise IllegalAction(f"{guess} is outside the range {self.low} to {self.high}")
        self.guesses.append(guess)
        if guess == self.target:
            return Outcome(1.0, terminated=True, success=True, message=f"{guess} is correct! You win.")
        if self.target > guess:
            self.lo = max(self.lo, guess + 1)
            return Outcome(0.0, message=f"{guess} is wrong: the number is higher than {guess}.")
        self.hi = min(self.hi, guess - 1)
        return Outcome(0.0, message=f"{guess} is wrong: the number is lower than {guess}.")

    def expert_reply(self) -> str:
        """Binary search: the middle of the interval the hints leave."""
        mid = (self.lo + self.hi) // 2
        return f"Between {self.lo} and {self.hi}, the middle is {mid}. \\boxed{{{mid}}}"

    def _on_truncate(self) -> str:
        return f"The number was {self.target}."

    def _action_format(self) -> str:
        return f"a single integer from {self.low} to {self.high}, e.g. \\boxed{{{(self.low + self.high) // 2}}}"

    def _rules(self) -> str:
        return (
            f"Guess the number: I hide an integer between {self.low} and {self.high} (inclusive). After each "
            f"guess I say whether the number is higher or lower. You have {self.max_steps} turns; a correct guess "
            "gives reward 1. Halving the remaining interval each turn always finds it in time."
        )

    def _example(self) -> str:
        mid = (self.low + self.high) // 2
        return f"The number is between {self.low} and {self.high}, so I guess the middle. \\boxed{{{mid}}}"
