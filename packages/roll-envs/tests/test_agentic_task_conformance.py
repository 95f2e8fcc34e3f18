"""The agentic task conformance suite (roll_core.testing.tasks.AgenticTaskTestSuite) over roll-envs' `AgenticTask`
for every installed agentic environment (the built-ins sokoban, frozen_lake, guess_number, tool_math, and any
out-of-tree `roll.agentic_envs` entry), and once with demonstrations (non-empty `examples()`). Held-out seeds start
at 100 so that drawing 64 training seeds would hit them if the split were wrong."""

from __future__ import annotations

from typing import ClassVar

import pytest

from roll_core import registry
from roll_core.testing.tasks import AgenticTaskTestSuite
from roll_envs.agentic.task import AgenticTask

IN_TREE = {"sokoban", "frozen_lake", "guess_number", "tool_math"}


class TestEveryInstalledAgenticEnvTask(AgenticTaskTestSuite):
    env_name: ClassVar[str] = ""

    @pytest.fixture(scope="class", autouse=True, params=registry.available("roll.agentic_envs"))
    @classmethod
    def _env(cls, request: pytest.FixtureRequest) -> None:
        cls.env_name = request.param

    @classmethod
    def build_agentic_task(cls) -> AgenticTask:
        return AgenticTask(cls.env_name, eval_seed_offset=100, eval_size=16)


class TestAgenticTaskWithDemonstrations(AgenticTaskTestSuite):
    @classmethod
    def build_agentic_task(cls) -> AgenticTask:
        task = AgenticTask("guess_number", eval_seed_offset=100, eval_size=16, demonstrations=1)
        assert task.examples(), "a demonstration gives example messages"
        return task


def test_in_tree_agentic_envs_are_discovered() -> None:
    """The suite above runs over the in-tree environments at least (a broken discovery would run zero cases)."""
    assert IN_TREE <= set(registry.available("roll.agentic_envs"))


class TestAgenticTaskWithUnseenEval(AgenticTaskTestSuite):
    """env.unseen_eval draws training seeds around the held-out boards: the suite's contract still holds."""

    @classmethod
    def build_agentic_task(cls) -> AgenticTask:
        return AgenticTask("sokoban", eval_seed_offset=100, eval_size=16, unseen_eval=True)
