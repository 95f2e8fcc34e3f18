"""Agentic environment plugins: an out-of-tree environment (tests/plugins/roll-dummy-engine, `roll.agentic_envs:
dummy_echo`) is named like a built-in, listed by roll-doctor and in the unknown-name error, and the environment
conformance suite runs over every installed agentic environment (built-ins included) with default arguments."""

from __future__ import annotations

from typing import Any

import pytest

from roll_core import registry
from roll_core.testing.envs import EnvTestSuite

pytest.importorskip("roll_dummy_engine", reason="install tests/plugins/roll-dummy-engine (nox does)")
make_env = pytest.importorskip("roll_envs.agentic").make_env


class TestEveryInstalledAgenticEnv(EnvTestSuite):
    """The suite over each `roll.agentic_envs` entry point, built by name through roll_envs' registry."""

    min_distinct = 1  # hidden-target games differ only after probing moves, which this generic sweep cannot know

    @pytest.fixture(autouse=True, params=registry.available("roll.agentic_envs"))
    def _name(self, request: pytest.FixtureRequest) -> None:
        type(self).env_name = request.param

    @classmethod
    def build_env(cls) -> Any:
        return make_env(cls.env_name)

    def test_step_limit_truncates(self) -> None:
        """Generic form: stalling ends the episode by `max_steps` at the latest (wrappers may end it sooner)."""
        env = self.build_env()
        env.reset(seed=0)
        for _ in range(getattr(env, "max_steps", 50)):
            _, _, terminated, truncated, _ = self.checked_step(env, self.stalling_action(env))
            if terminated or truncated:
                break
        assert truncated and not terminated


def test_plugin_env_is_named_like_a_builtin() -> None:
    from roll_envs.agentic import available_envs
    from roll_envs.agentic.task import AgenticTask

    assert "dummy_echo" in available_envs() and "sokoban" in available_envs()
    env = make_env("dummy_echo", rounds=2)
    assert type(env).__module__ == "roll_dummy_engine.env" and env.rounds == 2
    task = AgenticTask("dummy_echo", demonstrations=1)  # its expert plays the demonstration
    assert [m["role"] for m in task.examples()][:2] == ["user", "assistant"]
    with pytest.raises(ValueError, match=r"unknown environment .dummy_ecko.; available: .*dummy_echo"):
        make_env("dummy_ecko")


def test_doctor_lists_agentic_envs(doctor_output: str) -> None:
    line = next(ln for ln in doctor_output.splitlines() if ln.startswith("agentic environments"))
    assert "dummy_echo (roll-dummy-engine)" in line and "sokoban (roll-envs)" in line
