"""Adapters of third-party text environments to roll's `Env` contract: GEM environments by id, and any environment
with the Gymnasium API (reset -> (obs, info), step -> 5-tuple).

Both adapters return observations as `str` and a float reward, and add the info keys roll reads when the wrapped
environment does not set them: "success" (the wrapped info's "success", else its "is_success", Gymnasium's
convention (Gymnasium-Robotics, Stable-Baselines3), else `terminated and reward >= success_reward`),
"state" (the wrapped info's, else the observation) and "invalid_action" (the wrapped info's, else False).
What the wrapped environment returns is checked by roll's env manager's own rule (roll_core.agentic.step_values: a
ValueError naming the environment and the contract, which the env manager counts as an environment error): reset
returns (observation, info mapping or None), step a 5-tuple (observation, reward, terminated, truncated, info
mapping or None); the reward is a finite real number; terminated/truncated are bools or 0/1 (NumPy scalars are
read); the info's "success", "is_success" and "invalid_action" are bools or 0/1 (None reads as absent, as does a
"state" of None). An observation of None is an error (it reached the model as the text "None"), but on the step
that ends the episode, where it is the empty observation "" (no turn reads it); a first observation that is empty
(or only whitespace) is an error too: GEM states the task in it, and the model was asked to act on nothing.
`bool()` read the string "False" as True, an old-Gym reset returning the observation alone was split into
(observation, info), and an info that is a Mapping but not a dict (a MappingProxyType) was dropped with its success
flag.
Exceptions raised by the wrapped environment propagate: roll's env manager ends that trajectory and counts it as an
environment error, which keeps third-party bugs visible in the metrics instead of hiding them as truncations.
As for roll's built-ins (roll_envs.agentic.base), stepping a finished episode never reaches the wrapped environment:
it returns the last observation with reward 0, the same terminated/truncated flags and invalid_action True (a
Gymnasium environment stepped past its end goes on: FrozenLake at its goal paid the goal again); `step()` before
`reset()` is a RuntimeError. `close()` closes the wrapped environment (where it has one).
The wrapped environment reads the reply after its reasoning (the text after the last `</think>`,
roll_envs.rewards.judge.final_text, as roll's built-ins read actions): it parses replies itself, and a move named
in the reasoning was read as the move. A reply whose `<think>` block is never closed has no move: it is an invalid
action that never reaches the wrapped environment (reward `invalid_penalty`, -0.1 by default, GEM's own reward for
a format error; the previous observation repeated with what went wrong), counted towards `max_steps` like any step.
The trajectory keeps the whole reply (roll records the model's tokens, not this text).

GEM (`GemEnv("game:GuessTheNumber-v0-easy")`): `pip install --no-deps gem-llm` (it pins antlr4 4.13 while
omegaconf, hence Hydra, needs 4.9), plus what `import gem` needs: numpy and reasoning-gym (gem-llm 0.1.0 pins
reasoning-gym 0.1.23; 0.1.25 works too). GEM environments use the process-global `random` and NumPy RNGs (a seeded
`reset` calls `random.seed`), which would both clobber the trainer's RNGs and make concurrently stepped instances
interfere; the adapter therefore runs GEM calls one at a time with the global RNG states swapped for the
instance's own, so each instance is reproducible from its reset seed and the caller's RNGs are untouched. This
serialises GEM calls of a process (they are cheap for the game environments); a call that holds the RNGs for over
`rng_wait_s` (default 10 s; a hung environment) is handed over from, logged, so one hung instance never stalls the
others (`_PrivateGlobalRNG`). `import gem` also calls
`logging.basicConfig(INFO)`; the adapter restores the root logger's handlers and level afterwards.

Verified with gem-llm 0.1.0 on Python 3.11 without network (reset/seeded reset/step of each registered id):
- work offline: game:GuessTheNumber-v0-{easy,hard,random}, game:Mastermind-v0-{easy,hard,random},
  game:Minesweeper-v0-{easy,hard,random}, game:FifteenPuzzle-v0-{easy,hard}, game:Sudoku-v0-{easy,hard,random},
  game:TowerofHanoi-v0-{easy,hard,random}, game:Game2048-v0-{easy,hard,extreme-hard,random},
  game:Sokoban-v0-{easy,hard,random}, game:Crosswords-v0-{easy,hard} (needs pandas), and the single-turn rg:<name>
  reasoning-gym tasks (all but rg:boxnet and rg:composite);
- fail offline: game:Wordle-v0-*, game:Hangman-v0-*, game:WordSearch-v0-* (nltk's "words" corpus is downloaded at
  run time), math:*, code:*, qa:*, eval:* (Hugging Face datasets); game:FifteenPuzzle-v0-random and
  game:Crosswords-v0-random fail in GEM itself (TypeError / "No words found"), as do rg:boxnet and rg:composite.
GEM reports format errors as reward -0.1 with terminated True, which the adapter cannot tell from a failure; such
steps have invalid_action False unless GEM says otherwise.

Model-written code runs only in roll's sandbox (roll_envs.sandbox): GEM's code environments (`code:*`,
`eval:CodeContest`: `RUNS_MODEL_CODE`) run the model's programs through GEM's own runner (by default a plain
`python -c` as this user) and are refused with a ValueError unless
`allow_unsandboxed_execution_i_understand_the_risk=True` (then loudly logged); `check_code_execution` is that
rule, shared with the SkyRL-Gym adapter.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

from roll_core.agentic.step_values import checked_flag, checked_reset, checked_step
from roll_envs.rewards.judge import final_text

log = logging.getLogger(__name__)

#: What the model is told when its reply has no move: a `<think>` block never closed (a reply cut off reasoning).
UNCLOSED_THINK = "the reply's <think> block is never closed, so it holds no move."

#: Entry-point modules of GEM environments that execute the model's code outside roll's sandbox (module docstring).
RUNS_MODEL_CODE = {"gem.envs.code_env": "GEM runs its programs itself, by default with `python -c` as this user"}


def check_code_execution(
    library: str, env_id: str, entry_point: Any, runs_code: Mapping[str, str], allowed: bool
) -> None:
    """Refuse (ValueError) a `library` environment whose entry point (`module:Class` or the class) is in a module of
    `runs_code` (module -> how it runs the model's code outside roll's sandbox), unless `allowed` (then a warning)."""
    where = entry_point if isinstance(entry_point, str) else getattr(entry_point, "__module__", "")
    module = str(where).partition(":")[0]
    how = next((v for k, v in runs_code.items() if module == k or module.startswith(k + ".")), None)
    if how is None:
        return
    if not allowed:
        raise ValueError(
            f"{library} environment {env_id!r} runs the model's code outside roll's sandbox ({how}): that code "
            "could read and change this machine's files. Use roll's code tasks or `code` tool (sandboxed), or set "
            "+env.env_kwargs.allow_unsandboxed_execution_i_understand_the_risk=true"
        )
    log.warning("%s environment %r runs the model's code outside roll's sandbox (%s), as set", library, env_id, how)


class _PrivateGlobalRNG:
    """Swaps the process-global `random` (and NumPy's legacy global RNG, if NumPy is loaded) for an instance's own
    states during a call, one call of the process at a time.

    A call that holds the global RNGs for more than `wait_s` (a GEM environment that hangs: roll's env manager gives
    up on it after its step timeout, but a thread cannot be killed) is handed over from: the next call takes them
    (logged, counted in `handovers`), and the hung call, if it ever returns, leaves the global states alone (its
    instance is dropped by the env manager). Before, it held one process-wide lock for good, and every GEM episode
    of the process timed out from then on, healthy instances included, one leaked thread each. A hung call that
    still draws from `random` can disturb the draws of the calls after the hand-over: nothing can stop it."""

    _guard: ClassVar[threading.Condition] = threading.Condition()
    # Under _guard: the call using the global RNGs (a token), since when, the process's own states it saved on
    # entry (restored by the last call out), and the calls handed over from.
    _holder: ClassVar[object | None] = None
    _since: ClassVar[float] = 0.0
    _outside: ClassVar[tuple[Any, Any]] = (None, None)
    _abandoned: ClassVar[set[object]] = set()
    handovers: ClassVar[int] = 0

    def __init__(self, seed: int | None, wait_s: float = 10.0) -> None:
        self._py: Any = random.Random(seed).getstate()
        self._np: Any = None  # taken over from the global state on first use (GEM seeds it in reset)
        self.wait_s = float(wait_s)

    def _enter(self, token: object) -> None:
        cls = type(self)
        with cls._guard:
            while cls._holder is not None:
                left = cls._since + self.wait_s - time.monotonic()
                if left <= 0:
                    cls._abandoned.add(cls._holder)
                    cls.handovers += 1
                    log.warning(
                        "a GEM call has held the global RNGs for over %.1fs (hung?): the next call goes on without "
                        "it (counted: %d)",
                        self.wait_s,
                        cls.handovers,
                    )
                    break
                cls._guard.wait(left)
            np = sys.modules.get("numpy")
            if cls._holder is None:  # a hand-over keeps the states the hung call saved: they are the process's
                cls._outside = (random.getstate(), np.random.get_state() if np is not None else None)
            cls._holder, cls._since = token, time.monotonic()
            random.setstate(self._py)
            if np is not None and self._np is not None:
                np.random.set_state(self._np)

    def _leave(self, token: object) -> None:
        cls = type(self)
        with cls._guard:
            if token in cls._abandoned:  # another call owns the global RNGs now: touch nothing
                cls._abandoned.discard(token)
                return
            self._py = random.getstate()
            saved_py, saved_np = cls._outside
            random.setstate(saved_py)
            np = sys.modules.get("numpy")  # the call may have imported it
            if np is not None:
                self._np = np.random.get_state()
                if saved_np is not None:
                    np.random.set_state(saved_np)
            cls._holder, cls._outside = None, (None, None)
            cls._guard.notify_all()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        token = object()
        self._enter(token)
        try:
            yield
        finally:
            self._leave(token)


class _Adapter:
    """Common conversion of a wrapped environment's outputs to roll's conventions."""

    invalid_penalty = -0.1  # reward of an invalid reply (GEM's own for a format error)

    def __init__(self, env: Any, success_reward: float, max_steps: int | None) -> None:
        self.env, self.success_reward, self.max_steps = env, float(success_reward), max_steps
        self.steps = 0  # steps of this episode, invalid ones included (the wrapped environment never sees those)
        self._last_obs = ""
        self._state = ""
        self._started = False
        self._end: tuple[bool, bool] | None = None  # (terminated, truncated) of the step that ended the episode

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def close(self) -> None:
        """Close the wrapped environment, where it has `close()` (roll's env manager calls this one: without it the
        wrapped environment's was never called)."""
        close = getattr(self.env, "close", None)
        if callable(close):
            self._call(close)

    @property
    def label(self) -> str:
        """The wrapped environment as error messages name it."""
        spec_id = getattr(getattr(self.env, "spec", None), "id", None)
        return f"Gymnasium environment {spec_id or type(self.env).__name__!r}"

    def _text(self, obs: Any) -> str:
        """A wrapped observation as the model reads it."""
        return str(obs)

    def _info(self, info: dict[str, Any], obs: str, reward: float = 0.0, terminated: bool = False) -> dict[str, Any]:
        """The checked info (roll_core.agentic.step_values.checked_info) with roll's keys added (module docstring)."""
        out = dict(info)

        def flag(key: str, default: bool) -> bool:
            value = out.get(key)
            return default if value is None else checked_flag(value, f'info["{key}"]', self.label, real=True)

        # Gymnasium's conventional key is `is_success` (a goal env pays 0 on success and -1 otherwise, so the reward
        # fallback read every success as a failure)
        out["success"] = flag("success", flag("is_success", terminated and reward >= self.success_reward))
        state = out.get("state")  # None reads as absent: it was the text "None"
        out["state"] = obs if state is None else str(state)
        out["invalid_action"] = flag("invalid_action", False)
        return out

    def _begin(self, obs: str, info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._last_obs, self._state, self._started, self._end = obs, info["state"], True, None
        self.steps = 0
        return obs, info

    def _at_limit(self) -> bool:
        return self.max_steps is not None and self.steps >= self.max_steps

    def _invalid(self, why: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """The answer to an invalid reply (the wrapped environment is not stepped); it ends the episode as a
        truncation at the step limit."""
        obs = f"Invalid action: {why}\n\n{self._last_obs}"
        info = {"success": False, "state": self._state, "invalid_action": True}
        truncated = self._at_limit()
        if truncated:
            obs += f"\n\nThe step limit ({self.max_steps}) is reached; the episode is over."
            self._end = (False, True)
        return obs, self.invalid_penalty, False, truncated, info

    def _finished(self) -> tuple[str, float, bool, bool, dict[str, Any]] | None:
        """The answer to a step that must not reach the wrapped environment (episode over), else None."""
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        if self._end is None:
            return None
        info = {"success": False, "state": self._state, "invalid_action": True}
        note = "The episode is over; no further actions are taken.\n\n"
        return note + self._last_obs, 0.0, *self._end, info

    def _record(
        self, obs: str, reward: float, terminated: bool, truncated: bool, info: Any
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        out = self._info(info, obs, reward, terminated)
        self._last_obs, self._state = obs, out["state"]
        if terminated or truncated:
            self._end = (terminated, truncated)
        return obs, reward, terminated, truncated, out

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        obs, info = checked_reset(self._call(self.env.reset, seed=seed), self.label)
        text = self._text(obs)
        if not text.strip():  # GEM (and a text game) states its task in the first observation
            raise ValueError(
                f"{self.label}: reset returned the empty observation {text!r}; the first observation is all the "
                "model is told of its task"
            )
        return self._begin(text, self._info(info, text))

    def _stepped(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Step the wrapped environment with `action` (a valid one) and record what it returned, checked."""
        result = self._call(self.env.step, action)
        obs, reward, terminated, truncated, info = checked_step(result, self.label)
        # Invalid replies used steps the wrapped environment's own turn limit never counted.
        truncated = not terminated and (truncated or self._at_limit())
        # a None observation that ends the episode is "" (step_values), not converted: obs_to_text expects the
        # environment's own observations
        return self._record("" if result[0] is None else self._text(obs), reward, terminated, truncated, info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        over = self._finished()
        if over is not None:
            return over
        self.steps += 1
        text = final_text(action if isinstance(action, str) else str(action))
        if text is None:
            return self._invalid(UNCLOSED_THINK)
        return self._stepped(text)


class GemEnv(_Adapter):
    """A GEM environment by id (`gem.make(env_id, **kwargs)`), e.g. `GemEnv("game:Sudoku-v0-easy")`."""

    def __init__(
        self,
        env_id: str,
        success_reward: float = 1.0,
        seed: int | None = None,
        allow_unsandboxed_execution_i_understand_the_risk: bool = False,
        rng_wait_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        self.env_id = env_id
        self._rng = _PrivateGlobalRNG(seed, wait_s=rng_wait_s)
        gem = _import_gem()
        from gem.envs.registration import ENV_REGISTRY

        spec = ENV_REGISTRY.get(env_id)  # an unknown id: gem.make's own error below
        if spec is not None:
            check_code_execution(
                "GEM", env_id, spec.entry_point, RUNS_MODEL_CODE, allow_unsandboxed_execution_i_understand_the_risk
            )
        with self._rng.active():  # GEM environments draw (and reset) in their constructors
            env = gem.make(env_id, **kwargs)
        max_turns = getattr(env, "max_turns", None)
        super().__init__(env, success_reward, max_turns if isinstance(max_turns, int) else None)

    @property
    def label(self) -> str:
        """The wrapped environment as error messages name it."""
        return f"GEM environment {getattr(self, 'env_id', type(self.env).__name__)!r}"

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._rng.active():
            return fn(*args, **kwargs)

    # No `instructions()`: GEM puts the rules and the action format in the first observation.


def _import_gem() -> Any:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    from roll_envs.config import GEM

    try:
        gem = GEM.load()
    finally:
        # `import gem` calls logging.basicConfig(level=INFO): undo it so roll's logging stays as configured.
        root.handlers[:] = handlers
        root.setLevel(level)
    return gem


class GymTextEnv(_Adapter):
    """A Gymnasium-API environment (an instance, or an id for `gymnasium.make(env_id, **kwargs)`) as a text env.

    Observations become `str(obs)` (or `obs_to_text(obs)`). The reply after its reasoning (module docstring) is
    passed as the action unless `action_parser` is given: it maps that text to the environment's action and returns
    None (or raises) for a reply that is not one; such replies are invalid actions (the wrapped environment is not
    stepped, reward `invalid_penalty`, the previous observation is repeated with what went wrong). Invalid replies
    count towards `max_steps` (the wrapped spec's `max_episode_steps`) like valid ones, as in roll's built-ins: the
    wrapped environment's own time limit never sees them, so a model that never acts was never truncated.
    """

    def __init__(
        self,
        env: Any,
        action_parser: Callable[[str], Any] | None = None,
        obs_to_text: Callable[[Any], str] = str,
        success_reward: float = 1.0,
        invalid_penalty: float = -0.1,
        **kwargs: Any,
    ) -> None:
        if isinstance(env, str):
            from roll_envs.config import GYMNASIUM

            gymnasium = GYMNASIUM.load()
            env = gymnasium.make(env, **kwargs)
        spec = getattr(env, "spec", None)
        limit = getattr(spec, "max_episode_steps", None)
        super().__init__(env, success_reward, limit if isinstance(limit, int) else None)
        self.action_parser, self.obs_to_text, self.invalid_penalty = action_parser, obs_to_text, float(invalid_penalty)

    def _text(self, obs: Any) -> str:
        """`obs_to_text(obs)`, which must be a str: anything else was passed on as it was (the env manager read a
        dict as text with pictures, None as the text "None")."""
        text = self.obs_to_text(obs)
        if not isinstance(text, str):
            raise ValueError(
                f"{self.label}: obs_to_text returned {type(text).__name__} {text!r:.80}; it must return a str"
            )
        return text

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        over = self._finished()
        if over is not None:
            return over
        self.steps += 1
        text = final_text(action if isinstance(action, str) else str(action))
        if text is None:
            return self._invalid(UNCLOSED_THINK)
        parsed: Any = text
        if self.action_parser is not None:
            try:
                parsed = self.action_parser(text)
            except Exception:  # the parser sees raw model text: any failure means "not an action"
                parsed = None
            if parsed is None:
                return self._invalid("the reply is not a valid action.")
        return self._stepped(parsed)
