"""Built-in tasks pass the task/reward conformance suite (roll_core.testing.tasks)."""

from __future__ import annotations

import itertools
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing.tasks import TaskTestSuite
from roll_envs.rewards.math import MathReward
from roll_envs.tasks import ArithmeticTask, CountdownReward, CountdownTask, FileTask


class TestArithmetic(TaskTestSuite):
    @classmethod
    def build_task(cls, seed: int) -> ArithmeticTask:
        return ArithmeticTask(MathReward(), digits=2, train_size=200, eval_size=40, seed=seed, examples=1)


class TestCountdown(TaskTestSuite):
    @classmethod
    def build_task(cls, seed: int) -> CountdownTask:
        return CountdownTask(CountdownReward(format_weight=0.1), train_size=200, eval_size=40, seed=seed)

    @classmethod
    def correct_response(cls, problem: Any) -> str:
        target, nums = problem.answer.split("|")
        return f"\\boxed{{{_solve([int(n) for n in nums.split(',')], int(target))}}}"


class TestFileTask(TaskTestSuite):
    path: Path | None = None

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def data(cls, tmp_path_factory: pytest.TempPathFactory):
        import json

        cls.path = tmp_path_factory.mktemp("data") / "rows.jsonl"
        rows = [{"prompt": f"What is {i} + {i}? Box it.", "answer": str(2 * i)} for i in range(300)]
        cls.path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    @classmethod
    def build_task(cls, seed: int) -> FileTask:
        return FileTask(MathReward(), path=str(cls.path), eval_size=30)  # split by id hash: seed-free


def _solve(nums: list[int], target: int) -> str:
    """Brute force: an expression over `nums` (each once, + - * /, left-nested) that equals `target`."""
    for order in itertools.permutations(nums):
        for ops in itertools.product("+-*/", repeat=len(nums) - 1):
            expr, value = str(order[0]), Fraction(order[0])
            ok = True
            for op, x in zip(ops, order[1:]):
                if op == "/" and x == 0:
                    ok = False
                    break
                value = {"+": value + x, "-": value - x, "*": value * x, "/": value / x}[op]
                expr = f"({expr} {op} {x})"
            if ok and value == target:
                return expr
    raise AssertionError(f"no solution for {nums} -> {target}")
