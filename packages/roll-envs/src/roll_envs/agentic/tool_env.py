"""Tool use: any environment (or a question/answer task) becomes one where the model may call tools between actions.

Tool-call syntax: a reply containing `<tool>NAME: ARGUMENT</tool>` (e.g. `<tool>calculator: 12*(3+4)</tool>`)
after its `<think>` reasoning, if any (one in the reasoning is not a call), is a tool call: the first
`<tool>...</tool>` block is run (any later ones, closed or not, are ignored, and the observation says how many; a
malformed or unclosed first block is an invalid action even when a later one is well formed), the environment
itself does not move, and the tool's output is the next observation. NAME is a tool's name; everything after the
first colon up to the block's `</tool>` (stripped) is the argument, which may hold the markers themselves (a
program printing `</tool>` or `</think>`): where a block and the reasoning end is
roll_envs.agentic._tool_syntax's reading. The Hermes / Qwen form that Qwen and Hermes models write,
`<tool_call>{"name": NAME, "arguments": {"input": ARGUMENT}}</tool_call>` (any one key; its value a string), is the
same call (with `hermes_calls=False`, the default True, it is text like any other): a reply's first block of either
form is its call, and one whose `arguments` are not exactly one string is an invalid call saying so, never an answer
(roll_envs.agentic._reply_call). Any reply without a block of either form after its reasoning is passed to the
wrapped environment as its action.
The wrapped environment's observations must be text (one with pictures is a ValueError, not its repr); the
framing markers in them are defanged as in a tool's output (below): an observation cannot pose as a tool's output.
`step()` before `reset()` is a RuntimeError (no tool runs), as for roll's built-ins.
Tools are given by name (`tools=["calculator", "code"]`), as a mapping with the name and the tool's options (what a
Hydra list entry gives: `{name: code, timeout_s: 2}`), or as built objects. Each episode allows `max_tool_calls`
calls (default 4; `max_tool_calls` >= 0, `max_steps` and `max_output_chars` >= 1, else a ValueError). A call over
the budget, to an unknown tool, or a malformed or unclosed `<tool>` block is an invalid action
(info["invalid_action"] True, reward `invalid_penalty`, nothing changes) whose observation says why; it does not
use the budget. The wrapper truncates after `max_steps` replies in all (default: the wrapped environment's limit
plus the tool budget), so a model that only calls tools still ends. `close()`
closes the wrapped environment (where it has one).

info["tool_calls"] is the number of tool calls *made in this step* (0 or 1; roll sums it over an episode) and
info["tool_calls_total"] the episode's count so far. info["tool_errors"] (0 or 1) says this step's call raised (any
Exception, or SystemExit: a tool calling `sys.exit` fails its call, not the step; KeyboardInterrupt propagates): the
model is shown `error: the tool failed (ExcType)`, the call uses the budget, and the first failure of each tool name
is logged with its traceback (once per process; later ones only counted), so a tool broken for the whole run shows.
info["ignored_tool_calls"] is the number of `<tool>` blocks after the first in this step's reply (not run); the
observation tells the model so. info["tool_error_outputs"] (0 or 1) says this step's call ran and its tool answered
with an error (a bad argument, a program that failed): by the output's own `ToolText.error` where the tool returns
one (the code tool: a program's printed lines come before its error line), else by an output starting with
`error:` (the tools' contract, roll_envs.agentic.tools); the call uses the budget. info["state"] is the wrapped
environment's state plus the tool calls made so far (what the model knows differs after a call).

A tool's output is cut to `max_output_chars` (default 2000) characters followed by `... [truncated: N more
characters]` (how much the model did not see, as the code tool says it), and is shown between `<tool_output>` and
`</tool_output>` lines followed by `(N tool calls left)`. The framing markers inside the output (any case, spaces
inside the brackets) are written in parentheses, `(/tool_output)`, as the judge does for its field markers
(roll_envs.markers.defang): a document or program that prints `</tool_output>` cannot close the block and write
text the model reads as the environment's own (a fake budget line or task message). A tool should return text;
anything else is shown as text: numbers as `str()`, and containers (dict, list, tuple, set), booleans
and None as JSON with sorted keys and sorted sets (the repr of a set of strings changes with the process's hash
seed, so the same episode showed the model a different observation from run to run). Tool names must be usable in
a call (letters, digits, `_` and `-`, not starting with a digit or `-`) and distinct: a ValueError otherwise (a
tool named `web.search` could never be called, and a second tool of one name replaced the first).

`QAEnv` turns one question/answer pair, or a roll task's problems, into a one-answer environment (with the task's
reward, the reward alone decides what is an answer and whether it is right; see QAEnv); `ToolMathEnv` is
a seeded multi-step arithmetic question answered with `\\boxed{N}`, with a calculator: reward 1 if correct, 0
otherwise; the episode terminates at the first numeric answer.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from roll_core.interfaces.tasks import answer_reader, reward_kwargs
from roll_envs._digit_groups import join_digit_groups
from roll_envs.agentic._reply_call import read_call
from roll_envs.agentic.base import Outcome, TextEnv, echo, extract_action, trim_action
from roll_envs.agentic.tools import Calculator, Tool, ToolText, get_tool
from roll_envs.markers import defang
from roll_envs.numeric import numbers_equal

_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
_NAME = re.compile(r"[A-Za-z_][\w-]*")  # the tool names a `<tool>` call can spell (roll_envs.agentic._reply_call)
_FRAMING = ("<tool_output>", "</tool_output>")  # the observation's framing (_defang)

log = logging.getLogger(__name__)

# Tool names whose failure was logged with its traceback in this process: each tool's first failure is logged
# (a tool broken for the whole run went unnoticed: the model saw "error" and nothing else did), later ones are
# only counted in info["tool_errors"] so that a broken tool does not flood the log. Envs run on several threads.
_LOGGED_TOOL_ERRORS: set[str] = set()
_LOGGED_LOCK = threading.Lock()


def _log_tool_error(name: str) -> None:
    """Log the exception being handled, with its traceback, if it is the first failure of tool `name` here."""
    with _LOGGED_LOCK:
        first = name not in _LOGGED_TOOL_ERRORS
        _LOGGED_TOOL_ERRORS.add(name)
    if first:
        log.exception(
            "tool %r raised (shown to the model as a failed call); its later failures are counted in "
            "info['tool_errors'], not logged",
            name,
        )


def _same_answer(given: str, answer: str) -> bool:
    """Numbers compare as numbers (1,000 = 1000.0; a comma only between groups of three digits: `1,5` is not 15),
    everything else as case- and space-insensitive text, the reference trimmed as the reply's action is (the
    action `U.S.A` of `\\boxed{U.S.A.}` was wrong against the reference `U.S.A.`)."""
    g, a = given.strip(), answer.strip()
    try:
        return numbers_equal(g, a)  # exact for integers (roll_envs.numeric)
    except ValueError:
        g, a = trim_action(g), trim_action(a)
        return " ".join(g.lower().split()) == " ".join(a.lower().split())


def _is_number(text: str) -> bool:
    """Whether `text` reads as a number to the env's own check (commas dropped; thousands written with spaces
    joined by the math grader's rule, roll_envs._digit_groups, as `_same_answer` reads them: `5 000` is a number,
    `3 4` is not)."""
    return _NUMBER.fullmatch(join_digit_groups(text.strip()).replace(",", "")) is not None


def _reads_boxes(reward: Any) -> bool:
    """Whether `reward`'s answer is its last `\\boxed{}`: it reads `\\boxed{42}` and finds nothing in a bare `42`."""
    read = getattr(reward, "extract_answer", None)
    return callable(read) and read("\\boxed{42}") is not None and read("42") is None


class QAEnv(TextEnv):
    """Answer a question: the first answer ends the episode with reward 1 if correct, else 0.

    `problems` are (question, answer) pairs or objects with `prompt` and `answer` (roll `Problem`s); the seed picks
    one. Who decides, with or without a task reward:

    - Without `reward`, the environment's own reading: the action text (last box, else last line; see
      roll_envs.agentic.base) is compared with the answer (`_same_answer`: numbers as numbers). When the answer is
      a number, a reply without a number is invalid rather than wrong.
    - With `reward` (a roll `Reward`), the reward alone decides what counts as an answer and whether it is correct,
      so the episode's reward is what the task's reward gives the same reply (the env's reading used to disagree:
      an unboxed `167` passed the env's check and MathReward scored it 0; `\\boxed{1000 dollars}` was invalid).
      The reply has an answer when the reward's `extract_answer(reply)` finds one (MathReward: the last non-empty
      `\\boxed{}`; an answer of only wrapping or empty boxes, `\\boxed{\\boxed{}}`, is none; an extractor that
      declares `choices` gets the problem's metadata `choices`, as the reward's `score` reads them: the visual
      reward's answer is the last choice named, and a reply naming none has no answer); a reward without
      `extract_answer` grades the whole reply, which then has an answer when it is not blank. A reply with an
      answer ends the episode: correct is `reward.score([reply], [answer]).correct[0]` on the whole reply (with
      `prompts`/`metadata` where `score` declares them, as roll's reward role gives them); one without is an
      invalid action. `instructions()` describe what the reward reads: `answer_format` when given, else
      `\\boxed{}` for a reward that reads `\\boxed{42}` and nothing in a bare `42`, else the reward's own reading.
      A reward that raises, or marks the reply `failed` (no verdict: a sandbox or judge failure), raises from
      `step`: roll's env manager counts the episode as an env_error instead of training on a fallback score.
    """

    name: ClassVar[str] = "qa"

    def __init__(
        self,
        problems: Sequence[Any],
        reward: Any | None = None,
        max_steps: int = 3,
        invalid_penalty: float = 0.0,
        seed: int | None = None,
        answer_format: str | None = None,
    ) -> None:
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty, seed=seed)
        self.problems = [(p.prompt, p.answer) if hasattr(p, "prompt") else (str(p[0]), str(p[1])) for p in problems]
        if not self.problems:
            raise ValueError("QAEnv needs at least one (question, answer) pair")
        # What roll's reward role passes a reward that declares `metadata`: the row's metadata and its domain.
        self._metadata = [
            {**getattr(p, "metadata", {}), "domain": p.domain} if hasattr(p, "domain") else {} for p in problems
        ]
        self.reward = reward
        self.answer_format = answer_format
        self._boxed = _reads_boxes(reward)
        self.question, self.answer = self.problems[0]
        self.metadata: dict[str, Any] = self._metadata[0]
        self._reply = ""

    @classmethod
    def from_task(cls, task: Any, split: str = "train", **kwargs: Any) -> QAEnv:
        """Problems of a roll task (`train_set()` or `eval_set()`), scored by its reward."""
        problems = task.train_set() if split == "train" else task.eval_set()
        return cls(problems, reward=task.reward, **kwargs)

    def _new_episode(self, rng: random.Random) -> None:
        i = rng.randrange(len(self.problems))
        self.question, self.answer = self.problems[i]
        self.metadata = self._metadata[i]

    def _render(self) -> str:
        return self.question

    # ---- with a reward: the reward reads the reply ---------------------------------------------------------------
    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._reply = action if isinstance(action, str) else str(action)
        if self.reward is None or not self._started or self._terminated or self._truncated:
            return super().step(action)  # the env's own reading; or the base's refusal / "episode is over"
        self.steps += 1
        if self._has_answer(self._reply):
            outcome = self._grade(self._reply)
            obs = f"{outcome.message}\n\n{self._render()}"
            reward, terminated, success, invalid = outcome.reward, True, outcome.success, False
        else:
            obs = f"Invalid action: no answer found in the reply. {self._answer_rule()}\n\n{self._render()}"
            reward, terminated, success, invalid = self.invalid_penalty, False, False, True
        truncated = not terminated and self.steps >= self.max_steps
        if truncated:
            obs += f"\n\nThe step limit ({self.max_steps}) is reached; the episode is over."
        self._terminated, self._truncated, self._last_obs = terminated, truncated, obs
        return obs, float(reward), terminated, truncated, self._info(success=success and terminated, invalid=invalid)

    def _has_answer(self, reply: str) -> bool:
        """Whether the reward finds an answer in `reply` (class docstring)."""
        read = getattr(self.reward, "extract_answer", None)
        if callable(read):
            # With the row's choices where the extractor takes them, as `score` reads the reply with its metadata
            # (the visual reward: a reply naming no choice has no answer, not its last word as one).
            found = answer_reader(read)(reply, self.metadata)
            # MathReward reads `\boxed{\boxed{}}` as the answer `\boxed{}`: nothing but an empty box answers nothing.
            return found is not None and extract_action(str(found)) is not None
        return bool(trim_action(reply))

    def _grade(self, reply: str) -> Outcome:
        # A reward that raises fails this episode as an env_error, counted by roll's env manager (it used to
        # score the answer wrong, silently: a broken reward looked like a model that never learns).
        context = reward_kwargs(self.reward, prompts=[self.question], metadata=[self.metadata])
        result = self.reward.score([reply], [self.answer], **context)
        if result.failed and result.failed[0]:
            raise RuntimeError(
                f"{type(self.reward).__name__} could not score the reply (RewardResult.failed; counters: "
                f"{result.counters}): its fallback score is no verdict to train on"
            )
        ok = bool(result.correct[0])
        return Outcome(float(ok), terminated=True, success=ok, message=self._verdict(ok))

    def _answer_rule(self) -> str:
        """What the reward reads as the answer (with a reward; class docstring)."""
        if self.answer_format:
            return f"Answer format: {self.answer_format}."
        if self._boxed:
            return (
                "Answer format: the final answer in \\boxed{}, e.g. \\boxed{42}. Only the last non-empty \\boxed{} "
                "of your reply is read and graded; a reply without one has no answer."
            )
        if callable(getattr(self.reward, "extract_answer", None)):
            return "Give the final answer as the question asks; a reply in which no answer is found has no answer."
        return "Your whole reply is read and graded; a blank reply has no answer."

    def instructions(self) -> str:
        if self.reward is None:
            return super().instructions()
        example = f"\nExample reply: {self._example()}" if self._boxed else ""
        return (
            f"{self._rules()}\n\n{self._answer_rule()} A reply without an answer changes nothing and scores "
            f"{self.invalid_penalty:g}. The episode ends after {self.max_steps} replies.{example}"
        )

    # ---- without a reward: the env's own reading (TextEnv.step) ----------------------------------------------------
    def _parse(self, action: str) -> str | None:
        if _is_number(self.answer):
            return action if _is_number(action) else None
        return action

    def _apply(self, action: str) -> Outcome:
        ok = _same_answer(action, self.answer)
        return Outcome(float(ok), terminated=True, success=ok, message=self._verdict(ok))

    def _verdict(self, ok: bool) -> str:
        return "Correct!" if ok else f"Wrong: the answer was {self.answer}."

    def _action_format(self) -> str:
        numeric = _is_number(self.answer)
        return "the final answer in \\boxed{}" + (" as a number, e.g. \\boxed{42}" if numeric else "")

    def _rules(self) -> str:
        return "Answer the question. Your first answer is final: reward 1 if it is correct, 0 otherwise."

    def _example(self) -> str:
        return "12 * 7 = 84, so the answer is \\boxed{84}."


_EXAMPLES = {"calculator": "12*(3+4)", "python": "12*(3+4)", "code": "print(sum(range(10)))"}


def _build_tool(spec: str | Mapping[str, Any] | Tool) -> Tool:
    """A tool from its name, a mapping {"name": NAME, **constructor kwargs} (what a Hydra list entry gives), or an
    already built tool."""
    if isinstance(spec, str):
        return get_tool(spec)
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        name = kwargs.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(
                f"a tool given as a mapping needs a 'name' key (e.g. {{name: code, timeout_s: 2}}), got {spec}"
            )
        return get_tool(name, **kwargs)
    return spec


def _jsonable(value: Any) -> Any:
    """`value` with its sets sorted (by their JSON text, so mixed types sort too), for a deterministic dump."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True, ensure_ascii=False, default=str))
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _tool_text(result: Any) -> str:
    """A tool's result as the text the model reads (module docstring): text as is, numbers by str(), containers,
    booleans and None as JSON with sorted keys and sets, anything else by str()."""
    if isinstance(result, str):
        return result
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return str(result)
    if result is None or isinstance(result, (bool, Mapping, list, tuple, set, frozenset)):
        return json.dumps(_jsonable(result), sort_keys=True, ensure_ascii=False, default=str)
    return str(result)


def _defang(output: str) -> str:
    """`output` with each framing marker it holds (`<tool_output>`, `</tool_output>`, any case or inner spaces) in
    parentheses: `(/tool_output)`. A document or program that printed `</tool_output>` closed the block early and
    what followed (`(9 tool calls left)`, a fake task message) read as the environment's own text."""
    return defang(output, _FRAMING, inner_spaces=True)


def _text(obs: Any, env: Any) -> str:
    """A wrapped environment's observation as text, its framing markers defanged (an observation that quotes
    `</tool_output>` and a budget line read as a tool's output). One with pictures is refused (ValueError: the
    episode fails as a counted env_error): the wrapper's observations are text, and str() of it showed the model a
    dict's repr with the pictures lost."""
    if not isinstance(obs, Mapping):
        return _defang(str(obs))
    if obs.get("images"):
        raise ValueError(
            f"ToolUseEnv wraps text environments: {type(env).__name__} returned an observation with "
            f"{len(obs['images'])} picture(s)"
        )
    return _defang(str(obs.get("text", "")))


class ToolUseEnv:
    """Wraps an environment so that the model can call tools between its actions; see the module docstring."""

    name: ClassVar[str] = "tool_use"

    def __init__(
        self,
        env: Any,
        tools: Sequence[str | Mapping[str, Any] | Tool] = ("calculator",),
        max_tool_calls: int = 4,
        invalid_penalty: float = -0.1,
        max_steps: int | None = None,
        max_output_chars: int = 2000,
        hermes_calls: bool = True,
    ) -> None:
        self.env = env
        self.hermes_calls = bool(hermes_calls)
        self.tools: dict[str, Tool] = {}
        for t in tools:
            tool = _build_tool(t)
            name = getattr(tool, "name", None)
            # A name the call syntax cannot spell made every call to the tool an invalid action, silently.
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ValueError(
                    f"tool name {name!r} cannot be called as <tool>NAME: ARGUMENT</tool>: use letters, digits, "
                    "'_' and '-', starting with a letter or '_'"
                )
            if name in self.tools:  # the later one silently replaced the earlier one
                raise ValueError(f"two tools are named {name!r}; tool names must be distinct")
            self.tools[name] = tool
        if not self.tools or max_tool_calls < 0:
            raise ValueError("ToolUseEnv needs at least one tool and max_tool_calls >= 0")
        if max_output_chars < 1 or (max_steps is not None and max_steps < 1):
            # max_output_chars=-5 cut the last 5 characters of every output, 0 showed none (marked truncated).
            raise ValueError(
                f"ToolUseEnv needs max_output_chars >= 1 and max_steps >= 1, got {max_output_chars}, {max_steps}"
            )
        self.max_tool_calls, self.invalid_penalty = max_tool_calls, float(invalid_penalty)
        inner = getattr(env, "max_steps", None)
        if max_steps is None:
            max_steps = (inner if isinstance(inner, int) else 20) + max_tool_calls
        self.max_steps, self.max_output_chars = int(max_steps), max_output_chars
        self.steps = self.calls = 0
        self._history: list[str] = []
        self._inner_state = ""
        self._last: tuple[str, bool, bool] = ("", False, False)  # observation, terminated, truncated
        self._started = False

    def instructions(self) -> str:
        inner = self.env.instructions() if hasattr(self.env, "instructions") else ""
        listed = "\n".join(f"- {t.name}: {t.description}" for t in self.tools.values())
        first = next(iter(self.tools.values())).name
        return (
            f"{inner}\n\nTools: you may call a tool instead of acting by writing exactly <tool>NAME: ARGUMENT</tool> "
            f"(one call per reply; the tool's output comes back as the next message). At most "
            f"{self.max_tool_calls} tool calls per episode; tool calls are not steps of the task above, and the "
            f"episode ends after {self.max_steps} replies in all. Available tools:\n{listed}\n"
            f"Example tool call: <tool>{first}: {_EXAMPLES.get(first, 'keywords')}</tool>"
        ).strip()

    def close(self) -> None:
        """Close the wrapped environment, where it has `close()` (roll's env manager calls the wrapper's)."""
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def _state(self) -> str:
        calls = "".join(f"\n[called {h}]" for h in self._history)
        return self._inner_state + calls

    def _info(
        self,
        info: dict[str, Any],
        obs: str,
        calls: int,
        invalid: bool,
        errors: int = 0,
        ignored: int = 0,
        error_outputs: int = 0,
    ) -> dict[str, Any]:
        out = dict(info)
        self._inner_state = str(info.get("state", obs))
        out.update(
            success=bool(info.get("success", False)),
            invalid_action=bool(invalid or info.get("invalid_action", False)),
            tool_calls=calls,
            tool_calls_total=self.calls,
            tool_errors=errors,
            ignored_tool_calls=ignored,
            tool_error_outputs=error_outputs,
        )
        out["state"] = self._state()
        return out

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        raw, info = self.env.reset(seed=seed)
        obs = _text(raw, self.env)
        self.steps = self.calls = 0
        self._history, self._last, self._started = [], (obs, False, False), True
        return obs, self._info(info, obs, 0, False)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        # Before reset a tool call ran the model's argument (the code tool: a sandbox run) against no episode.
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        text = action if isinstance(action, str) else str(action)
        obs, terminated, truncated = self._last
        if terminated or truncated:
            note = "The episode is over; no further actions are taken.\n\n"
            info = self._info({"state": self._inner_state}, obs, 0, True)
            return note + obs, 0.0, terminated, truncated, info
        self.steps += 1
        call = read_call(text, self.hermes_calls)  # a block in the reasoning is weighed, not called
        if call is None:  # (the wrapped env reads the action after the reasoning)
            raw, reward, terminated, truncated, info = self.env.step(text)
            obs, terminated = _text(raw, self.env), bool(terminated)
            truncated = not terminated and (bool(truncated) or self.steps >= self.max_steps)
            self._last = (obs, terminated, truncated)
            return obs, float(reward), terminated, truncated, self._info(info, obs, 0, False)
        errors, ignored, error_outputs = 0, call.ignored, 0
        if call.error is not None:  # malformed, unclosed (a reply cut off by max_tokens in its call)
            obs, invalid = call.error, True
        elif call.name not in self.tools:
            obs = f"Invalid tool call: unknown tool {echo(call.name)}; available: {', '.join(self.tools)}."
            invalid = True
        elif self.calls >= self.max_tool_calls:
            obs, invalid = f"Tool budget exhausted ({self.max_tool_calls} calls); give your action now.", True
        else:
            name, arg = call.name, call.arg
            try:
                result = self.tools[name](arg)
                output = _tool_text(result)
                # A ToolText says whether the call failed: a code run that printed and then crashed does not start
                # with "error:" (it was counted a success), one that printed "error: ..." and succeeded does.
                failed = result.error if isinstance(result, ToolText) else output.startswith("error:")
                error_outputs = int(failed)
            # A tool must not raise; a user tool that does is reported, not propagated. SystemExit too (a tool
            # calling sys.exit or exit() ended the step, and the env's caller, with it); KeyboardInterrupt is the
            # user's and goes through.
            except (Exception, SystemExit) as exc:
                output, errors = f"error: the tool failed ({type(exc).__name__})", 1
                _log_tool_error(name)
            if len(output) > self.max_output_chars:
                cut = len(output) - self.max_output_chars
                output = output[: self.max_output_chars] + f"... [truncated: {cut} more characters]"
            output = _defang(output)
            self.calls += 1
            self._history.append(f"{name}: {arg[:200]} -> {output[:200]}")
            left = self.max_tool_calls - self.calls
            obs, invalid = f"<tool_output>\n{output}\n</tool_output>\n({left} tool calls left)", False
        if ignored:  # the model was not told that its later calls never ran
            obs += f"\nnote: only the first tool call of a reply runs; {ignored} ignored."
        truncated = self.steps >= self.max_steps
        if truncated:
            obs += f"\nThe step limit ({self.max_steps}) is reached; the episode is over."
        self._last = (obs, False, truncated)
        calls = 0 if invalid else 1
        info = self._info({"state": self._inner_state}, obs, calls, invalid, errors, ignored, error_outputs)
        return obs, self.invalid_penalty if invalid else 0.0, False, truncated, info


class ArithmeticQAEnv(QAEnv):
    """One seeded arithmetic question: `terms` numbers of `digits` digits joined by operators from `ops`."""

    name: ClassVar[str] = "arithmetic_qa"

    def __init__(
        self,
        terms: tuple[int, int] = (2, 3),
        digits: tuple[int, int] = (2, 3),
        ops: str = "+-*",
        max_steps: int = 3,
        invalid_penalty: float = 0.0,
        seed: int | None = None,
    ) -> None:
        super().__init__([("", "0")], max_steps=max_steps, invalid_penalty=invalid_penalty, seed=seed)
        if min(terms) < 2 or min(digits) < 1 or not ops or set(ops) - set("+-*"):
            raise ValueError(f"need terms >= 2, digits >= 1 and ops from '+-*', got {terms}, {digits}, {ops!r}")
        self.terms, self.digits, self.ops = terms, digits, ops
        self.expression = ""

    def _new_episode(self, rng: random.Random) -> None:
        n = rng.randint(*self.terms)
        numbers = []
        for _ in range(n):
            d = rng.randint(*self.digits)
            numbers.append(rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1))
        expr = str(numbers[0])
        for x in numbers[1:]:
            expr += f" {rng.choice(self.ops)} {x}"
        self.expression = expr
        self.answer = str(Calculator().evaluate(expr))
        self.question = f"What is {expr}? Give the final answer as \\boxed{{N}}."


class ToolMathEnv(ToolUseEnv):
    """Multi-turn arithmetic with a calculator: reward 1 for a correct `\\boxed{N}`, 0 otherwise."""

    name: ClassVar[str] = "tool_math"

    def __init__(
        self,
        terms: tuple[int, int] = (2, 3),
        digits: tuple[int, int] = (2, 3),
        ops: str = "+-*",
        max_tool_calls: int = 4,
        max_answers: int = 3,
        tools: Sequence[str | Mapping[str, Any] | Tool] = ("calculator",),
        invalid_penalty: float = 0.0,
        seed: int | None = None,
    ) -> None:
        inner = ArithmeticQAEnv(
            terms=(int(terms[0]), int(terms[-1])),
            digits=(int(digits[0]), int(digits[-1])),
            ops=ops,
            max_steps=max_answers,
            invalid_penalty=invalid_penalty,
            seed=seed,
        )
        super().__init__(inner, tools=tools, max_tool_calls=max_tool_calls, invalid_penalty=invalid_penalty)

    def expert_reply(self) -> str:
        """Ask the calculator first, then answer with its result."""
        inner = self.env
        if self.calls == 0 and "calculator" in self.tools:
            return f"<tool>calculator: {inner.expression}</tool>"
        if self.calls == 0 and "code" in self.tools:
            return f"<tool>code: print({inner.expression})</tool>"
        return f"The tool says {inner.answer}, so the answer is \\boxed{{{inner.answer}}}."
