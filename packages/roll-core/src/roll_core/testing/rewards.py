"""Conformance suite of the reward contract (`roll_core.interfaces.Reward`): every reward passes it.

Checks: the `Reward` protocol; one score per response, finite, with `correct` and `formatted` in {0, 1} and a
correct response also formatted; counters are non-negative ints by name; the suite's known cases score as they
should (each correct case correct with a positive score, each wrong one not, correct ones scoring higher on
average); malformed responses (empty, whitespace, huge, binary junk, control characters, lone surrogates, other
scripts, emoji, unbalanced boxes and fences) are scored, never raised on, and never correct; malformed ground
truths (user data) are scored without raising; results are deterministic (twice on one instance, and on a fresh
one); an empty batch gives an empty result and responses without as many answers are a ValueError.

Usage (roll-envs' rewards subclass it in packages/roll-envs/tests/test_reward_conformance.py)::

    from roll_core.testing.rewards import Case, RewardTestSuite

    class TestMyReward(RewardTestSuite):
        reward_class = MyReward  # built with no arguments; or override build_reward()
        cases = (Case("the answer is \\\\boxed{7}", "7", correct=True), Case("no idea", "7", correct=False))

`build_reward` may raise `roll_core.testing.CannotRunHere` (or ImportError) when the reward cannot run here (no
sandbox, a missing optional dependency): the suite skips with the message. Keep `cases` small: a sandboxed reward
runs a program per case.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import pytest

from roll_core.interfaces import Reward, RewardResult
from roll_core.testing import CannotRunHere

__all__ = ["MALFORMED_ANSWERS", "MALFORMED_RESPONSES", "Case", "RewardTestSuite", "check_result"]

#: Responses no reward may raise on or count as correct (index of the one that may parse: see NESTED_BOX).
MALFORMED_RESPONSES = [
    "",
    "   \n\t  ",
    "x" * 100_000,
    "7 " * 20_000,
    bytes(range(256)).decode("latin-1"),
    "\x00\x07\x1b[31m\x7f",
    "\ud800 lone surrogate \udfff",
    "\\boxed{",
    "}}}{{{",
    "```python\nprint(1)\n",  # a fence never closed
    "向上 答案是七",
    "🙂🙃 \u202e\u200b",
    "\\boxed{\\boxed{}}",
]
#: The one malformed response a reward may legitimately parse (an empty inner box); its correctness is not checked.
NESTED_BOX = len(MALFORMED_RESPONSES) - 1
#: Ground truths that are not in any reward's format (user data can be anything): scored, never raised on. Short:
#: math-verify spends its whole timeout (5 s) parsing a 10,000-character one.
MALFORMED_ANSWERS = ["", "}{", "x" * 500, "\ud800", "|", '{"tests": 3}', "🙂"]


class Case(NamedTuple):
    """A response, its ground truth, and whether the reward must count it as correct."""

    response: str
    answer: str
    correct: bool


def check_result(res: object, n: int) -> RewardResult:
    """Assert that `res` is a well-formed `RewardResult` of `n` responses and return it."""
    assert isinstance(res, RewardResult), f"score() must return a RewardResult, got {type(res).__name__}"
    for field in ("scores", "correct", "formatted"):
        values = getattr(res, field)
        assert len(values) == n, f"{field}: {len(values)} entries for {n} responses"
        for v in values:
            assert isinstance(v, (int, float)) and not isinstance(v, bool), f"{field}: {v!r} is not a number"
            assert math.isfinite(v), f"{field}: {v!r} is not finite"
    assert all(v in (0.0, 1.0) for v in res.correct), f"correct must be 0/1: {res.correct}"
    assert all(v in (0.0, 1.0) for v in res.formatted), f"formatted must be 0/1: {res.formatted}"
    assert all(f == 1.0 for c, f in zip(res.correct, res.formatted) if c == 1.0), "a correct response is formatted"
    assert isinstance(res.counters, dict), f"counters must be a dict, got {type(res.counters).__name__}"
    for key, count in res.counters.items():
        assert isinstance(key, str), f"counter name {key!r} is not a str"
        assert isinstance(count, int) and not isinstance(count, bool), f"counter {key}={count!r} is not an int"
        assert count >= 0, f"counter {key}={count} is negative"
    return res


class RewardTestSuite:
    """Shared tests; subclasses set `reward_class` (or implement `build_reward`) and `cases`."""

    #: The reward under test, built with no arguments by the default `build_reward`.
    reward_class: ClassVar[type | None] = None
    #: Known responses: at least one correct and one wrong case.
    cases: ClassVar[Sequence[Case]] = ()

    @classmethod
    def build_reward(cls) -> Reward:
        if cls.reward_class is None:
            raise NotImplementedError("subclasses set reward_class or return a reward from build_reward")
        return cls.reward_class()

    @classmethod
    def _build(cls) -> Reward:
        try:
            return cls.build_reward()
        except (ImportError, CannotRunHere) as exc:
            pytest.skip(f"reward {cls.__qualname__} cannot run here: {type(exc).__name__}: {exc}")

    @pytest.fixture(scope="class")
    @classmethod
    def reward(cls) -> Reward:
        if not any(c.correct for c in cls.cases) or all(c.correct for c in cls.cases):
            raise NotImplementedError(f"{cls.__qualname__}.cases needs at least one correct and one wrong Case")
        return cls._build()

    def _score(self, reward: Reward, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        return check_result(reward.score(list(responses), list(answers)), len(responses))

    def test_satisfies_protocol(self, reward: Reward) -> None:
        assert isinstance(reward, Reward), f"{type(reward).__name__} has no score(responses, answers)"

    def test_known_cases(self, reward: Reward) -> None:
        res = self._score(reward, [c.response for c in self.cases], [c.answer for c in self.cases])
        for case, correct, score in zip(self.cases, res.correct, res.scores):
            assert correct == float(case.correct), f"{case.response[:60]!r} vs {case.answer[:60]!r}: {correct}"
            if case.correct:
                assert score > 0, f"the correct {case.response[:60]!r} scored {score}"
        right = [s for c, s in zip(self.cases, res.scores) if c.correct]
        wrong = [s for c, s in zip(self.cases, res.scores) if not c.correct]
        assert sum(right) / len(right) > sum(wrong) / len(wrong), "correct responses must score higher"

    def test_malformed_responses_are_scored_never_correct(self, reward: Reward) -> None:
        answer = next(c.answer for c in self.cases if c.correct)
        res = self._score(reward, MALFORMED_RESPONSES, [answer] * len(MALFORMED_RESPONSES))
        wrongly = [
            repr(r[:30]) for i, (r, c) in enumerate(zip(MALFORMED_RESPONSES, res.correct)) if c and i != NESTED_BOX
        ]
        assert not wrongly, f"malformed responses counted as correct: {wrongly}"

    def test_malformed_answers_are_scored(self, reward: Reward) -> None:
        response = next(c.response for c in self.cases if c.correct)
        self._score(reward, [response] * len(MALFORMED_ANSWERS), MALFORMED_ANSWERS)

    def test_deterministic(self, reward: Reward) -> None:
        responses = [c.response for c in self.cases] + MALFORMED_RESPONSES[:4]
        answers = [c.answer for c in self.cases] + [self.cases[0].answer] * 4
        first = self._score(reward, responses, answers)
        assert self._score(reward, responses, answers) == first, "the same batch scored twice differs"
        assert self._score(self._build(), responses, answers) == first, "a fresh instance scores differently"

    def test_batch_shapes(self, reward: Reward) -> None:
        self._score(reward, [], [])
        case = self.cases[0]
        with pytest.raises(ValueError):
            reward.score([case.response, case.response], [case.answer])
