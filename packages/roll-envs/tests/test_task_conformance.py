"""The task/reward conformance suite (roll_core.testing.tasks) over every installed `roll.envs` entry point,
in-tree (`arithmetic`, `countdown`, `file`, `code`; their rewards `math`, `countdown` and `code` with them) or
out-of-tree. Each is built by its class's `conformance_task` hook; one that cannot run here (e.g. `code` without a
working sandbox) skips with the reason."""

from __future__ import annotations

import pytest

from roll_core import registry
from roll_core.testing.tasks import HOOK, TaskTestSuite

IN_TREE = {"arithmetic", "countdown", "file", "code", "instruct"}


class TestEveryInstalledTask(TaskTestSuite):
    @pytest.fixture(scope="class", autouse=True, params=registry.available("roll.envs"))
    @classmethod
    def _task(cls, request: pytest.FixtureRequest) -> None:
        cls.task_class = registry.load("roll.envs", request.param)


def test_in_tree_tasks_are_discovered_and_buildable() -> None:
    """The loop above runs over the in-tree tasks at least (a broken discovery would run zero cases), and each of
    them says how to build a test instance (a task without the hook would only be skipped)."""
    assert IN_TREE <= set(registry.available("roll.envs"))
    assert all(hasattr(registry.load("roll.envs", name), HOOK) for name in IN_TREE)
