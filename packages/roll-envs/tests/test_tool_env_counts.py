"""ToolUseEnv tells and counts what used to pass unseen: a tool that raises (counted in info, its first failure logged
with the traceback once per tool) and the tool calls of a reply after the first (never run: the model is told)."""

from __future__ import annotations

import logging

import pytest

from roll_envs.agentic import GuessNumberEnv, ToolUseEnv, tool_env


def _broken(name: str) -> object:
    def tool(arg: str) -> str:
        raise RuntimeError(f"{name} is broken")

    tool.name, tool.description = name, "always fails"  # type: ignore[attr-defined]
    return tool


@pytest.fixture(autouse=True)
def _fresh_log_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tool_env, "_LOGGED_TOOL_ERRORS", set(), raising=False)


def test_a_failing_tool_is_counted_and_its_first_failure_logged_with_the_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = ToolUseEnv(GuessNumberEnv(), tools=["calculator", _broken("boom"), _broken("bang")], max_tool_calls=4)
    _, info = env.reset(seed=0)
    assert info["tool_errors"] == 0
    with caplog.at_level(logging.WARNING, logger=tool_env.__name__):
        calls = ("boom: x", "boom: y", "calculator: 1+1", "bang: z")
        steps = [env.step(f"<tool>{call}</tool>") for call in calls]
    errors = [info["tool_errors"] for *_, info in steps]
    assert errors == [1, 1, 0, 1]
    assert all(info["tool_calls"] == 1 and not info["invalid_action"] for *_, info in steps)
    assert "error: the tool failed (RuntimeError)" in steps[0][0]
    logged = [r for r in caplog.records if r.name == tool_env.__name__]
    # once per tool: boom's second failure is counted, not logged again
    assert [r.getMessage().split(" raised")[0] for r in logged] == ["tool 'boom'", "tool 'bang'"]
    assert all(r.exc_info is not None and "is broken" in str(r.exc_info[1]) for r in logged)


def test_the_ignored_tool_calls_of_a_reply_are_told_and_counted() -> None:
    env = ToolUseEnv(GuessNumberEnv(), tools=["calculator"], max_tool_calls=1)
    env.reset(seed=0)
    obs, _, _, _, info = env.step(
        "<tool>calculator: 1+1</tool> <tool>calculator: 2+2</tool> <tool>calculator: 3</tool>"
    )
    assert "2" in obs and "note: only the first tool call of a reply runs; 2 ignored." in obs
    assert info["ignored_tool_calls"] == 2 and info["tool_calls"] == 1 and info["tool_calls_total"] == 1
    # an invalid first call (here: over the budget) is told about the others too
    obs, _, _, _, info = env.step("<tool>calculator: 1</tool><tool>calculator: 2</tool>")
    assert info["invalid_action"] and "budget exhausted" in obs and "1 ignored" in obs
    assert info["ignored_tool_calls"] == 1
    obs, _, _, _, info = env.step("<tool>calculator: 1</tool>")
    assert info["ignored_tool_calls"] == 0 and "ignored" not in obs
    _, _, _, _, info = env.step(f"\\boxed{{{env.env.target}}}")
    assert info["ignored_tool_calls"] == 0 and info["tool_errors"] == 0 and info["success"]
