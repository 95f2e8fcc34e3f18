"""An agentic task: which environment, which seeds, what the model is told, and where episodes stop.

The agentic pipeline (roll_core.pipelines.collectors.episodes) builds one from the `env` config group (env=sokoban,
env=frozen_lake, ...). Training seeds are drawn per step from [0, eval_seed_offset) and held-out seeds are
[eval_seed_offset, eval_seed_offset + eval_size): the two seed sets never meet. They are not disjoint boards by
default: the built-in games draw from small spaces (measured with the shipped sizes: 30 of frozen_lake's 32 held-out
boards, 24 of sokoban's 32 and every guess_number target also occur in training within a run), so held-out success
measures play on the training distribution. `unseen_eval=True` makes it measure generalisation: a training seed
whose board is a held-out one is skipped (the next one drawn instead). A seed's board is the environment's
`board_key()` after `reset(seed)` where it has one (guess_number: its hidden number), else reset's info["state"]
(the built-in games' canonical state; None is none, arrays keyed by their bytes:
roll_core.agentic.observation.info_state_key), else the first observation; where the held-out boards leave too few
training boards to draw from, `train_seeds` raises a ValueError naming the setting.

Demonstrations (`demonstrations: N`): N solved episodes, played by the environment's expert (`expert_reply()`) on
seeds of their own (counted down from `DEMO_SEED_TOP`), are shown before every episode as earlier user/assistant turns.
They are part of the prompt (never trained on) and are how a small model learns the action format from one worked
example, like `env.examples` of the single-turn tasks.

`env.env_kwargs` are checked against the environment's constructor (`check_env_kwargs`: a misspelt key names the
config key and what is taken) when the task builds an environment, and already when the config is validated
(`check_config_env_kwargs`, from roll_envs.config: the signature only, nothing built; `py:` classes wait for the run).
"""

from __future__ import annotations

import hashlib
import pickle
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

from roll_core.agentic.observation import info_state_key
from roll_core.interfaces import Env

#: The first demonstration episode's seed; later ones count down from it.
DEMO_SEED_TOP = 2**31 - 1


def check_env_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any], env: str) -> None:
    """ConfigError naming `env.env_kwargs.<key>` for a keyword the environment's constructor (`factory`, the
    environment `env`'s class) does not take, with a did-you-mean and the arguments it takes, and for an argument it
    needs that is not given. A misspelt key was a bare TypeError from the constructor ("unexpected keyword
    argument"), which named neither the config key nor what is accepted. A constructor taking `**kwargs` (the GEM
    and Gym adapters pass them on) or one whose signature cannot be read is left to its own checks."""
    import difflib
    import inspect

    from roll_core.errors import ConfigError

    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    named = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    accepted = [p.name for p in named]
    takes = ", ".join(accepted) or "no arguments"
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"env.env_kwargs.{key}: {env} takes no argument {key!r}{hint}; it takes: {takes}")
    missing = [p.name for p in named if p.default is inspect.Parameter.empty and p.name not in kwargs]
    if missing:
        raise ConfigError(
            f"env.env_kwargs: {env} needs {', '.join(missing)} (+env.env_kwargs.{missing[0]}=<value>); "
            f"it takes: {takes}"
        )


def factory_kwargs(env: str, env_kwargs: Mapping[str, Any], eval_seed_offset: int) -> dict[str, Any]:
    """The keyword arguments `AgenticTask.make_env` gives the factory of a registered or prefixed `env`:
    `env_kwargs`, and a dataset-backed (`skyrl:`) environment's `eval_seed_offset` unless given."""
    kwargs = dict(env_kwargs)
    if env.startswith("skyrl:"):  # a dataset-backed env: it maps held-out seeds to held-out rows
        kwargs.setdefault("eval_seed_offset", eval_seed_offset)
    return kwargs


def check_config_env_kwargs(env: str, env_kwargs: Mapping[str, Any], eval_seed_offset: int) -> None:
    """`check_env_kwargs` at config validation (roll_envs.config.AgenticEnvConfig), from the constructor's signature
    alone: no environment is built. The factory comes from the `roll.agentic_envs` registry or an adapter prefix
    (importing the environment's module, as the run does). Left to the run, which names them: a `py:<module>:<Class>`
    environment (importing the user's own module, with whatever it does on import, is not done to validate a
    config), and a name that does not resolve (unknown, or its module fails to import).

    Raises:
        ConfigError: as `check_env_kwargs`.
    """
    from roll_core.registry import PluginError

    if env.startswith("py:"):
        return
    from roll_envs.agentic.registry import env_factory

    try:
        factory = env_factory(env)
    except (ValueError, ImportError, PluginError):
        return
    check_env_kwargs(factory, factory_kwargs(env, env_kwargs, eval_seed_offset), env)


class AgenticTask:
    """Environment factory, seeds and episode limits of an agentic run."""

    is_agentic = True

    def __init__(
        self,
        env: str,
        name: str | None = None,
        env_kwargs: dict[str, Any] | None = None,
        max_turns: int = 8,
        max_context_length: int = 2048,
        max_tokens_per_turn: int = 128,
        step_timeout_s: float = 30.0,
        on_failure: str = "score",
        failure_reward: float = 0.0,
        env_threads: int = 16,
        num_workers: int = 0,
        eval_size: int = 32,
        eval_seed_offset: int = 1_000_000,
        system_prompt: str | None = None,
        demonstrations: int = 0,
        unseen_eval: bool = False,
    ) -> None:
        self.env, self.name = env, name or env
        self.env_kwargs = dict(env_kwargs or {})
        self.max_turns, self.max_context_length, self.max_tokens_per_turn = (
            max_turns,
            max_context_length,
            max_tokens_per_turn,
        )
        self.step_timeout_s, self.env_threads, self.num_workers = step_timeout_s, env_threads, num_workers
        if on_failure not in ("score", "drop"):
            raise ValueError(f"env.on_failure={on_failure!r} must be score or drop")
        # read by roll_core's episode collectors (an AgenticTask without them scores failures 0.0)
        self.on_failure, self.failure_reward = on_failure, float(failure_reward)
        self.eval_size, self.eval_seed_offset = eval_size, eval_seed_offset
        self._system_prompt = system_prompt
        # fails here, with the registry's message for an unknown name, a ConfigError for bad env_kwargs
        probe = self.make_env()
        # A dataset-backed environment's training rows left out as held out and its held-out rows neither trained
        # nor evaluated (skyrl:<id>'s split_rows), for the run's metrics and summary
        # (roll_core.interfaces.tasks.DataCounts); None for seeded games (nothing to count).
        self.also_held_out: int | None = getattr(probe, "also_held_out", None)
        self.unused_held_out: int | None = getattr(probe, "unused_held_out", None)
        self._instructions = probe.instructions() if hasattr(probe, "instructions") else ""
        self._examples = self._demonstrate(int(demonstrations))
        # unseen_eval: the held-out boards, and each training seed's board once looked up (one env, one at a time:
        # the asynchronous collector draws seeds from its own thread).
        self._boards: dict[int, str] = {}
        self._board_lock = threading.Lock()
        self._held_out: frozenset[str] = (
            frozenset(self._board(s) for s in self.eval_seeds()) if unseen_eval else frozenset()
        )

    def _demonstrate(self, count: int) -> list[dict[str, str]]:
        """Messages of `count` expert episodes (user: observation, assistant: expert reply, ...)."""
        if count <= 0:
            return []
        messages: list[dict[str, str]] = []
        env = self.make_env()
        if not callable(getattr(env, "expert_reply", None)):
            raise ValueError(f"env.demonstrations needs an environment with expert_reply(); {self.env} has none")
        # Seeds counted down from the top of the 31-bit range: apart from the training and held-out seeds, and the
        # same whatever env.eval_size is (a resumed run may change it; its demonstrations must not change).
        seed = DEMO_SEED_TOP
        if seed - 20 * count < self.eval_seed_offset + self.eval_size:
            raise ValueError(f"env.eval_seed_offset + env.eval_size reach the demonstrations' seeds ({seed} down)")
        tried = 0
        while len(messages) < 1 or sum(m["role"] == "demo_end" for m in messages) < count:
            if tried >= 20 * count:
                raise ValueError(f"the expert of {self.env} solved fewer than {count} of {tried} episodes")
            obs, _ = env.reset(seed=seed - tried)
            if not isinstance(obs, str) and (obs.get("images") if isinstance(obs, dict) else None):
                # Demonstrations are text turns before every prompt; their pictures would be a second prompt
                # prefix of pictures in every request (not supported: say so rather than drop the pictures).
                raise ValueError(f"env.demonstrations: {self.env}'s observations hold pictures; use demonstrations: 0")
            tried += 1
            episode: list[dict[str, str]] = []
            for _ in range(self.max_turns):
                reply = env.expert_reply()
                if reply is None:
                    break
                episode += [{"role": "user", "content": str(obs)}, {"role": "assistant", "content": reply}]
                obs, _, terminated, truncated, info = env.step(reply)
                if terminated or truncated:
                    if info.get("success"):
                        messages += [*episode, {"role": "demo_end", "content": ""}]
                    break
        return [m for m in messages if m["role"] != "demo_end"]

    def examples(self) -> list[dict[str, str]]:
        """Demonstration messages shown before every episode (empty without `demonstrations`)."""
        return list(self._examples)

    def make_env(self) -> Env:
        """A new environment instance: a built-in or GEM/Gym name (roll_envs.agentic.registry), or
        `py:<module>:<Class>` for an environment class of your own."""
        if self.env.startswith("py:"):
            import importlib

            module, _, cls = self.env.removeprefix("py:").partition(":")
            if not cls:
                raise ValueError(f"env={self.env!r}: write py:<module>:<Class>")
            try:
                env_cls = getattr(importlib.import_module(module), cls)
            except (ImportError, AttributeError) as exc:
                raise ValueError(
                    f"env={self.env!r}: cannot load {module}.{cls} ({exc}); the module must be importable wherever "
                    "environments run (env workers on Ray: install it or put its folder on PYTHONPATH)"
                ) from exc
            check_env_kwargs(env_cls, self.env_kwargs, self.env)
            return env_cls(**self.env_kwargs)
        from roll_envs.agentic.registry import env_factory

        kwargs = factory_kwargs(self.env, self.env_kwargs, self.eval_seed_offset)
        factory = env_factory(self.env)
        check_env_kwargs(factory, kwargs, self.env)
        return factory(**kwargs)

    def system_prompt(self) -> str | None:
        """The configured system prompt, else the environment's own instructions (rules and action format)."""
        return self._system_prompt if self._system_prompt is not None else (self._instructions or None)

    def train_seeds(self, count: int, seed: int) -> list[int]:
        """`count` distinct training seeds drawn with `seed` (every one below the held-out range; with unseen_eval,
        none whose board is a held-out one)."""
        rng = random.Random(seed)
        if not self._held_out:
            return rng.sample(range(self.eval_seed_offset), count)
        seeds: list[int] = []
        tried: set[int] = set()
        for _ in range(100 * count + 1000):
            candidate = rng.randrange(self.eval_seed_offset)
            if candidate in tried:
                continue
            tried.add(candidate)
            if self._board(candidate) not in self._held_out:
                seeds.append(candidate)
                if len(seeds) == count:
                    return seeds
        raise ValueError(
            f"env.unseen_eval: only {len(seeds)} of {len(tried)} training seeds of {self.env} drawn gave a board that "
            f"is not one of the {len(self._held_out)} held-out boards, and a step needs {count}: the environment has "
            "too few boards for a held-out set of this size (lower env.eval_size, enlarge the board space with "
            "env.env_kwargs, or set env.unseen_eval=false)"
        )

    def _board(self, seed: int) -> str:
        """What makes `seed`'s episode the board it is (see the module docstring), computed once per seed."""
        with self._board_lock:
            if seed not in self._boards:
                if not hasattr(self, "_board_env"):
                    self._board_env = self.make_env()
                env = self._board_env
                obs, info = env.reset(seed=seed)
                # The rollout's rule for a state (roll_core.agentic.step_values.checked_info): None is no state. Read
                # as the text "None", every board of an environment without one was the same held-out board.
                state = info.get("state") if isinstance(info, Mapping) else None
                key = getattr(env, "board_key", None)
                if callable(key):
                    board = str(key())
                elif state is not None:
                    # an array's digest, not its text: printed, boards above 1,000 cells were summarised with "..."
                    board = info_state_key(state)
                else:  # pictures too: the observation's bytes
                    board = hashlib.sha256(pickle.dumps(obs)).hexdigest()
                self._boards[seed] = board
            return self._boards[seed]

    def eval_seeds(self) -> list[int]:
        return list(range(self.eval_seed_offset, self.eval_seed_offset + self.eval_size))
