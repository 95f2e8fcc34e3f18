"""Base class of roll's built-in text environments: action parsing, invalid actions, step limits and info keys.

Contract (on top of `roll_core.interfaces.Env`):
- The action is read from the model's reply after its reasoning (the text after the last `</think>`, as rewards
  read answers: roll_envs.rewards.judge.final_text; a reply whose `<think>` block is never closed has no action):
  the content of the *last* `\\boxed{...}` if that text has one
  with balanced braces, else the *last line that holds more than wrapping* (a closing code fence or `**` line is
  passed over), stripped. `\\text{...}` wrappers, surrounding whitespace of any script (no-break, ideographic),
  zero-width characters, quotes, `*` and backticks, and trailing `.`/`!` (also the fullwidth and ideographic
  `．`/`！`/`。`) are removed; the environment matches the rest (see `instructions()`). Direction words are read
  after NFKC normalisation (fullwidth `ｕｐ` is `up`). Actions longer than `MAX_ACTION_CHARS` are never read.
- A reply that yields no action, or an action that is illegal in the current state, changes nothing: the reward is
  `invalid_penalty` (default -0.1), terminated is False, info["invalid_action"] is True, and the observation says
  what a valid action looks like. It still counts as a step, so a model that never acts is truncated.
- After `max_steps` steps (valid or not) without reaching a terminal state, the episode is truncated.
- Every info has "success" (bool, True only on the step that reaches the goal), "state" (canonical text of the state
  the next action acts on: equal states have equal keys, whatever the wording of the observation) and
  "invalid_action" (bool). reset's info adds "seed".
- `reset(seed)` is deterministic: all randomness comes from `random.Random` instances seeded from `seed`, never from
  the global RNG. `reset(None)` draws the episode seed from the environment's own RNG (seeded by the constructor's
  `seed`), so a sequence of unseeded resets is reproducible too.
- `step()` never raises for any reply. Stepping a finished episode returns its last observation with reward 0,
  the same terminated/truncated flags and invalid_action True. Calling `step()` before `reset()` is a programming
  error (RuntimeError), not a model error.
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, ClassVar

from roll_envs.boxed import extract_boxed
from roll_envs.rewards.judge import final_text

_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|texttt)\s*\{([^{}]*)\}")

#: Direction words and the single letters accepted for them (case-insensitive), as (row, column) offsets.
DIRECTIONS: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_DIRECTION_ALIASES = {**{d: d for d in DIRECTIONS}, "u": "up", "d": "down", "l": "left", "r": "right"}


#: Wrapping around an action: quotes, markdown emphasis and code, and zero-width characters (not whitespace to
#: str.strip, so "\u200bup" was no action and its repr was all the model was shown).
_WRAPPING = "`*\"'\u200b\u200c\u200d\u2060\ufeff"
_TRAILING = ".!\uff0e\uff01\u3002"


def trim_action(text: str) -> str:
    """`text` without the wrapping `extract_action` removes (LaTeX text wrappers, quotes, markdown, trailing
    `.`/`!`); QAEnv trims reference answers alike, so an answer written as its reference reads is equal to it."""
    text = _TEXT_WRAP.sub(r"\1", text)
    before = None
    while text != before:  # until nothing more comes off (e.g. `**up**.`)
        before = text
        text = text.strip().strip(_WRAPPING).rstrip(_TRAILING)
    return text


def extract_action(reply: str) -> str | None:
    """The action text of a reply after its reasoning (last box, else last line with more than wrapping),
    normalised; None when there is none (a `<think>` block never closed included)."""
    # A thinking model's reasoning weighs moves ("\boxed{left} would hit a hole"): its last box or line is no action.
    answer = final_text(reply)
    if answer is None:
        return None
    reply = answer
    text = extract_boxed(reply)
    if text is None:
        # A closing ``` or ** line after the action is wrapping, not a (missing) action.
        text = next((t for t in map(trim_action, reversed(reply.splitlines())) if t), None)
    else:
        text = trim_action(text)
    return text or None


def parse_direction(text: str) -> str | None:
    """`up`/`down`/`left`/`right` for a direction word or its first letter (any case, fullwidth forms too), else
    None."""
    return _DIRECTION_ALIASES.get(unicodedata.normalize("NFKC", text).strip().lower())


def echo(text: str, limit: int = 40) -> str:
    """A short, printable quotation of model text for an observation (control characters and lone surrogates are
    escaped by repr, so the observation is always valid UTF-8 for the tokenizer)."""
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


class IllegalAction(Exception):
    """Raised by `TextEnv._apply` for a parsed action not allowed in the current state; the state must be unchanged.
    The message says why (it is shown to the model)."""


@dataclass
class Outcome:
    """What a legal action did."""

    reward: float = 0.0
    terminated: bool = False
    success: bool = False
    #: Shown before the rendering of the new state.
    message: str = ""


class TextEnv:
    """A seeded, turn-based text environment; subclasses implement the hooks below."""

    name: ClassVar[str] = "text_env"
    #: Longest action text read (longer ones are invalid without being parsed).
    MAX_ACTION_CHARS: ClassVar[int] = 200

    def __init__(self, max_steps: int, invalid_penalty: float = -0.1, seed: int | None = None) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = int(max_steps)
        self.invalid_penalty = float(invalid_penalty)
        self._seeds = random.Random(seed)  # None: OS entropy (never the global RNG)
        self.seed: int | None = None
        self.steps = 0
        self._started = False
        self._terminated = False
        self._truncated = False
        self._last_obs = ""

    # ---- hooks ----------------------------------------------------------------------------------------------
    def _new_episode(self, rng: random.Random) -> None:
        """Build the episode's instance from `rng` (the only source of randomness for it)."""
        raise NotImplementedError

    def _render(self) -> str:
        """Observation text of the current state (what the model sees after every step)."""
        raise NotImplementedError

    def _state_key(self) -> str:
        """Canonical key of the current state (default: the rendering)."""
        return self._render()

    def _parse(self, action: str) -> Any | None:
        """The environment's action for an action text, or None when it is not one. Must not raise."""
        raise NotImplementedError

    def _apply(self, action: Any) -> Outcome:
        """Apply a parsed action; raise `IllegalAction` (state unchanged) when it is not allowed now."""
        raise NotImplementedError

    def _action_format(self) -> str:
        """What a valid action looks like, e.g. "one of up, down, left, right (or U, D, L, R)"."""
        raise NotImplementedError

    def _rules(self) -> str:
        """The game's rules, in a few sentences."""
        raise NotImplementedError

    def _example(self) -> str:
        """One short example reply."""
        raise NotImplementedError

    def _on_truncate(self) -> str:
        """Extra text shown when the step limit ends the episode (e.g. the hidden answer)."""
        return ""

    def expert_reply(self) -> str | None:
        """A good reply in the current state (solvers, binary search...), for demonstrations in the prompt
        (`env.demonstrations`); None when the environment has no expert."""
        return None

    # ---- the Env API ----------------------------------------------------------------------------------------
    def instructions(self) -> str:
        """Rules, action format and an example reply (used as the system prompt)."""
        return (
            f"{self._rules()}\n\n"
            f"Action format: {self._action_format()}. End your reply with the action in \\boxed{{}}; without a box, "
            "the last non-empty line of your reply is read as the action. An invalid or illegal action changes "
            f"nothing and scores {self.invalid_penalty:g}. The episode ends after {self.max_steps} steps.\n"
            f"Example reply: {self._example()}"
        )

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode from `seed` (or the next seed of the environment's own RNG)."""
        self.seed = int(seed) if seed is not None else self._seeds.getrandbits(32)
        self._new_episode(random.Random(self.seed))
        self.steps = 0
        self._started, self._terminated, self._truncated = True, False, False
        self._last_obs = self._render()
        return self._last_obs, {**self._info(success=False, invalid=False), "seed": self.seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply the model's reply; see the module docstring for the rules."""
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        if self._terminated or self._truncated:
            note = "The episode is over; no further actions are taken.\n\n"
            return note + self._last_obs, 0.0, self._terminated, self._truncated, self._info(False, True)
        self.steps += 1
        text = extract_action(action if isinstance(action, str) else str(action))
        outcome: Outcome | None = None
        if text is None:
            reason = "no action found in the reply"
            if isinstance(action, str) and final_text(action) is None:  # (cut off while reasoning, say)
                reason = "the <think> block is never closed: no action after it"
        elif len(text) > self.MAX_ACTION_CHARS:
            reason = f"the action is too long ({len(text)} characters)"
        else:
            parsed = self._parse(text)
            if parsed is None:
                reason = f"{echo(text)} is not an action"
            else:
                try:
                    outcome = self._apply(parsed)
                except IllegalAction as exc:
                    reason = str(exc)
        if outcome is None:
            obs = f"Invalid action: {reason}. A valid action is {self._action_format()}.\n\n{self._render()}"
            reward, terminated, success, invalid = self.invalid_penalty, False, False, True
        else:
            body = self._render()
            obs = f"{outcome.message}\n\n{body}" if outcome.message else body
            reward, terminated, success, invalid = outcome.reward, outcome.terminated, outcome.success, False
        truncated = not terminated and self.steps >= self.max_steps
        if truncated:
            obs += f"\n\nThe step limit ({self.max_steps}) is reached; the episode is over. {self._on_truncate()}"
            obs = obs.rstrip()
        self._terminated, self._truncated, self._last_obs = terminated, truncated, obs
        return obs, float(reward), terminated, truncated, self._info(success=success and terminated, invalid=invalid)

    def _info(self, success: bool, invalid: bool) -> dict[str, Any]:
        return {"success": bool(success), "state": self._state_key(), "invalid_action": bool(invalid)}
