"""Conformance suite of the task and reward contract (`roll_core.interfaces.Task` / `Reward`).

Usage::

    from roll_core.testing.tasks import TaskTestSuite

    class TestMyTask(TaskTestSuite):
        @classmethod
        def build_task(cls, seed: int):
            return MyTask(MyReward(), seed=seed)

        @classmethod
        def correct_response(cls, problem) -> str:  # a response the reward must count as correct
            return f"\\\\boxed{{{problem.answer}}}"

Checks: seeded determinism, disjoint train/held-out splits, chat messages ending with the problem's prompt, a
correct response scores as correct, and malformed responses (empty, garbage, huge, control characters, lone
surrogates) score as incorrect with finite scores instead of raising.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from roll_core.interfaces import ProblemLike, RewardResult, Task

MALFORMED = ["", "\\boxed{", "}}}{{{", "x" * 100_000, "\x00\x07\x1b[31m", "\ud800 lone surrogate", "\\boxed{\\boxed{}}"]


class TaskTestSuite:
    """Shared tests; subclasses implement `build_task` and, if the default does not fit, `correct_response`."""

    #: Problems scored by the correctness check (keep it fast).
    sample: ClassVar[int] = 20

    @classmethod
    def build_task(cls, seed: int) -> Task:
        raise NotImplementedError

    @classmethod
    def correct_response(cls, problem: Any) -> str:
        return f"The answer is \\boxed{{{problem.answer}}}."

    def test_satisfies_protocol(self) -> None:
        task = self.build_task(0)
        assert isinstance(task, Task) and task.name
        assert task.train_set() and task.eval_set()
        assert all(isinstance(p, ProblemLike) for p in [*task.train_set()[:5], *task.eval_set()[:5]])

    def test_seeded_and_disjoint(self) -> None:
        a, b = self.build_task(0), self.build_task(0)
        assert [p.id for p in a.train_set()] == [p.id for p in b.train_set()]
        assert [p.id for p in a.eval_set()] == [p.id for p in b.eval_set()]
        train, held = {p.id for p in a.train_set()}, {p.id for p in a.eval_set()}
        assert not train & held, "a held-out problem is also a training problem"
        assert not {p.prompt for p in a.train_set()} & {p.prompt for p in a.eval_set()}

    def test_messages_end_with_the_prompt(self) -> None:
        task = self.build_task(0)
        p = task.eval_set()[0]
        msgs = task.messages(p)
        assert msgs[-1] == {"role": "user", "content": p.prompt}
        assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str) for m in msgs)

    def test_correct_responses_score_correct(self) -> None:
        task = self.build_task(0)
        probs = list(task.eval_set()[: self.sample])
        res = task.reward.score([self.correct_response(p) for p in probs], [p.answer for p in probs])
        assert isinstance(res, RewardResult)
        assert res.correct == [1.0] * len(probs), res
        assert all(s > 0 for s in res.scores)

    def test_malformed_responses_score_incorrect_without_raising(self) -> None:
        task = self.build_task(0)
        p = task.eval_set()[0]
        res = task.reward.score(MALFORMED, [p.answer] * len(MALFORMED))
        assert len(res.scores) == len(MALFORMED)
        assert all(math.isfinite(s) for s in res.scores)
        assert res.correct[:-1] == [0.0] * (len(MALFORMED) - 1)  # the last one may parse as an empty box
