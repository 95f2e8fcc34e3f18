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


def _returning(name: str, value: object) -> object:
    def tool(arg: str) -> object:
        return value

    tool.name, tool.description = name, "returns a fixed value"  # type: ignore[attr-defined]
    return tool


def test_tool_names_a_call_cannot_spell_or_given_twice_are_refused() -> None:
    """A tool named `web.search` could never be called (every call was an invalid "write exactly" action), and a
    second tool of one name silently replaced the first."""
    with pytest.raises(ValueError, match=r"tool name 'web\.search' cannot be called"):
        ToolUseEnv(GuessNumberEnv(), tools=[_returning("web.search", "x")])
    with pytest.raises(ValueError, match=r"tool name '2nd' cannot be called"):
        ToolUseEnv(GuessNumberEnv(), tools=[_returning("2nd", "x")])
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolUseEnv(GuessNumberEnv(), tools=["calculator", {"name": "calculator", "max_digits": 10}])
    env = ToolUseEnv(GuessNumberEnv(), tools=[_returning("web_search-2", "found")])
    env.reset(seed=0)
    assert env.step("<tool>web_search-2: q</tool>")[0].startswith("<tool_output>\nfound\n")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ({"b": 1, "a": ["é", 2.5]}, '{"a": ["é", 2.5], "b": 1}'),
        ({"z", "a", "m"}, '["a", "m", "z"]'),
        ((1, {"y": None, "x": True}), '[1, {"x": true, "y": null}]'),
        (None, "null"),
        (42, "42"),
        (0.5, "0.5"),
    ],
)
def test_non_text_tool_results_are_shown_as_deterministic_text(value: object, shown: str) -> None:
    """str() of a tool's dict showed a Python repr in the key order it was built in, and of a set an order that
    changes with the process's hash seed: the same episode showed the model different observations."""
    env = ToolUseEnv(GuessNumberEnv(), tools=[_returning("lookup", value)])
    env.reset(seed=0)
    obs, reward, _, _, info = env.step("<tool>lookup: q</tool>")
    assert obs.startswith(f"<tool_output>\n{shown}\n</tool_output>\n") and reward == 0
    assert info["tool_calls"] == 1 and info["tool_errors"] == 0 and not info["invalid_action"]


def test_a_tool_answering_with_an_error_is_counted() -> None:
    """A call whose tool answers `error: ...` (a bad argument) is shown to the model and counted in
    info["tool_error_outputs"]; it is a valid call that uses the budget, neither invalid nor a raised tool."""
    env = ToolUseEnv(GuessNumberEnv(), tools=["calculator"], max_tool_calls=3)
    env.reset(seed=0)
    obs, reward, _, _, info = env.step("<tool>calculator: 1/0</tool>")
    assert "<tool_output>\nerror: division by zero\n" in obs and reward == 0
    assert info["tool_error_outputs"] == 1 and info["tool_errors"] == 0 and info["tool_calls"] == 1
    assert not info["invalid_action"] and info["tool_calls_total"] == 1
    _, _, _, _, info = env.step("<tool>calculator:</tool>")  # missing argument
    assert info["tool_error_outputs"] == 1 and info["tool_calls_total"] == 2
    _, _, _, _, info = env.step("<tool>calculator: 6*7</tool>")
    assert info["tool_error_outputs"] == 0 and info["tool_calls"] == 1
    _, _, _, _, info = env.step("<tool>nope: 1</tool>")  # invalid: no tool ran
    assert info["tool_error_outputs"] == 0 and info["invalid_action"]
