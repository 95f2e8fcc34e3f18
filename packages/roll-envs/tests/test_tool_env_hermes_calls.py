"""ToolUseEnv takes the Hermes / Qwen tool call (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
roll_envs.agentic._reply_call) as the same call as `<tool>NAME: ARGUMENT</tool>`: it was passed on as the answer, and
with the shipped `tool_math` config (`max_answers: 1`) a Qwen model's first call ended its episode ("Invalid
action: '</tool_call>' is not an action"). A malformed one is an invalid call that says why and uses no budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import roll_envs
from roll_envs.agentic import GuessNumberEnv, ToolUseEnv
from roll_envs.agentic.tool_env import ToolMathEnv


def _shipped_tool_math(seed: int = 3) -> ToolMathEnv:
    """ToolMathEnv as `env=tool_math` builds it (its env_kwargs: max_answers 1)."""
    conf = OmegaConf.load(Path(roll_envs.__file__).parent / "conf" / "env" / "tool_math.yaml")
    kwargs = OmegaConf.to_container(conf.env_kwargs)
    assert kwargs["max_answers"] == 1  # the setting under which a misread call ended the episode
    return ToolMathEnv(**kwargs, seed=seed)


def _hermes(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _recorder(name: str = "code") -> tuple[Any, list[str]]:
    seen: list[str] = []

    def tool(arg: str) -> str:
        seen.append(arg)
        return "ran"

    tool.name, tool.description = name, "records its argument"  # type: ignore[attr-defined]
    return tool, seen


def _call_then_answer(call: Any) -> list[tuple[Any, ...]]:
    """The shipped tool_math episode: reset, the call (`call(expression)` gives the reply), then the right answer."""
    env = _shipped_tool_math()
    env.reset(seed=3)
    expr, answer = env.env.expression, env.env.answer
    return [env.step(call(expr)), env.step(f"So the answer is \\boxed{{{answer}}}.")]


@pytest.mark.parametrize(
    "call",
    [
        lambda e: _hermes("calculator", {"expression": e}),
        lambda e: "I'll compute it.\n" + _hermes("calculator", json.dumps({"input": f" {e} "})),  # JSON text, spaced
    ],
)
def test_a_hermes_call_is_the_same_call_as_the_envs_own(call: Any) -> None:
    own = _call_then_answer(lambda e: f"<tool>calculator: {e}</tool>")
    hermes = _call_then_answer(call)
    assert hermes == own  # observations, rewards, flags and info alike, the calculator's output included
    (obs, reward, done, _, info), (_, final, solved, _, end) = hermes
    assert obs.startswith("<tool_output>\n") and info["tool_calls"] == 1 and not info["invalid_action"]
    assert (reward, done) == (0.0, False)
    assert (final, solved, end["success"], end["tool_calls_total"]) == (1.0, True, True, 1)


@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        ({}, "got 0 members"),
        ({"a": "1", "b": "2"}, "got 2 members"),
        ({"expression": 12}, "got a number"),
        ({"expression": ["1+1"]}, "got an array"),
    ],
)
def test_a_hermes_call_without_one_string_argument_is_invalid_and_costs_nothing(arguments: Any, why: str) -> None:
    env = _shipped_tool_math()
    env.reset(seed=3)
    obs, reward, done, truncated, info = env.step(_hermes("calculator", arguments))
    assert obs.startswith('Invalid tool call: the "arguments" of a <tool_call>') and why in obs
    assert reward == env.invalid_penalty
    assert info["invalid_action"] and info["tool_calls"] == 0 and not (done or truncated)
    # neither the one answer nor the tool budget was used: the calls left and the answer still count
    obs, *_ = env.step(_hermes("calculator", {"expression": env.env.expression}))
    assert obs.endswith(f"({env.max_tool_calls - 1} tool calls left)")
    assert env.step(f"\\boxed{{{env.env.answer}}}")[1:3] == (1.0, True)


@pytest.mark.parametrize(
    ("reply", "obs"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"x": "1"}', "Invalid tool call: a <tool_call> block"),
        ('<tool_call>{"name": "", "arguments": {"x": "1"}}</tool_call>', "Invalid tool call: a <tool_call> block"),
        (_hermes("wolfram", {"q": "1+1"}), "Invalid tool call: unknown tool 'wolfram'; available: calculator."),
    ],
)
def test_a_malformed_hermes_call_says_why(reply: str, obs: str) -> None:
    env = _shipped_tool_math()
    env.reset(seed=3)
    got, _, done, truncated, info = env.step(reply)
    assert got.startswith(obs) and info["invalid_action"] and not (done or truncated)


@pytest.mark.parametrize(
    ("reply", "ran", "ignored"),
    [
        (_hermes("code", {"code": "a"}) + " <tool>code: b</tool>", ["a"], 1),
        ("<tool>code: a</tool> " + _hermes("code", {"code": "b"}), ["a"], 1),
        (_hermes("code", {"code": "a"}) + _hermes("code", {"code": "b"}), ["a"], 1),
        # markers of the other form inside an argument are the argument's, not calls
        (_hermes("code", {"code": "print('<tool>x: 1</tool>')"}), ["print('<tool>x: 1</tool>')"], 0),
        (f"<tool>code: print('{_hermes('x', {'y': '1'})}')</tool>", [f"print('{_hermes('x', {'y': '1'})}')"], 0),
        # a call while thinking is weighed, not made
        (f"<think>{_hermes('code', {'code': 'a'})}</think>\n<tool>code: b</tool>", ["b"], 0),
    ],
)
def test_the_first_call_of_either_form_runs(reply: str, ran: list[str], ignored: int) -> None:
    tool, seen = _recorder()
    env = ToolUseEnv(GuessNumberEnv(), tools=[tool])
    env.reset(seed=0)
    _, _, _, _, info = env.step(reply)
    assert seen == ran and info["ignored_tool_calls"] == ignored and info["tool_calls"] == 1


def test_hermes_calls_can_be_left_to_the_wrapped_environment() -> None:
    """`hermes_calls=False`: an environment whose actions are Hermes calls gets them as its actions."""
    tool, seen = _recorder()
    inner = GuessNumberEnv()
    env = ToolUseEnv(inner, tools=[tool], hermes_calls=False)
    env.reset(seed=0)
    _, _, _, _, info = env.step(_hermes("code", {"code": "a"}))
    assert seen == [] and info["tool_calls"] == 0 and inner.steps == 1
