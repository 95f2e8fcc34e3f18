"""Conformance suite of the agentic environment contract (`roll_core.interfaces.Env`).

Usage::

    from roll_core.testing.envs import EnvTestSuite

    class TestMyEnv(EnvTestSuite):
        @classmethod
        def build_env(cls):
            return MyEnv()

        @classmethod
        def solving_actions(cls, env, seed):  # called right after env.reset(seed); None skips the solving check
            return ["\\\\boxed{up}", "\\\\boxed{left}"]

        @classmethod
        def illegal_actions(cls, env, seed):  # well-formed replies that are illegal in the reset state (optional)
            return ["\\\\boxed{down}"]

Checks: the `Env` protocol; `reset(seed)` determinism (same seed, same observation and same responses to
`probe_actions`; different seeds give different instances for most seeds); `step` never raises on malformed replies
(empty, whitespace, huge, control characters, lone surrogates, unbalanced boxes, other scripts, emoji) or on
well-formed illegal ones, and marks them `invalid_action` with the state unchanged and a finite, non-positive reward;
the info keys roll reads ("success", "state", "invalid_action") with their types on every reset and step; a solving
sequence ends terminated with success on its last step only and a positive total reward; the step limit
(`env.max_steps`, when the environment has one) truncates; stepping a finished episode does not raise; and
`instructions()`, when provided, is non-empty text; `close()`, when provided, does not raise on a fresh instance
or after an episode; `expert_reply()`, when provided, wins every seed's episode
(`expert_always_wins = False` for environments where luck decides, e.g. slippery ice).

Observations may be text or text with pictures (`{"text": str, "images": [...]}`, roll_core.agentic.observation):
the checks read the text part, pictures must load, and instances are told apart by text and picture digests.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pytest

from roll_core.agentic.observation import images_of, normalize, text_of
from roll_core.interfaces import Env, EnvWithInstructions
from roll_core.interfaces.agentic import INFO_COUNTERS

MALFORMED = [
    "",
    "   \n\t  ",
    "x" * 100_000,
    "\x00\x07\x1b[31m",
    "\ud800 lone surrogate",
    "\\boxed{",
    "}}}{{{",
    "\\boxed{\\boxed{}}",
    "向上",
    "🙂🙃",
    "I am not sure what to do here.",
]


class EnvTestSuite:
    """Shared tests; subclasses implement `build_env` and, where they can, `solving_actions`."""

    #: Seeds the checks run on.
    seeds: ClassVar[tuple[int, ...]] = (0, 1, 2, 3, 4)
    #: Replies stepped after reset to tell instances apart when the first observation does not (hidden targets).
    probe_actions: ClassVar[tuple[str, ...]] = ()
    #: How many of 20 seeds must give distinct instances (first observation plus probe responses).
    min_distinct: ClassVar[int] = 10
    #: Whether following `expert_reply()` (when the environment has one) wins every episode.
    expert_always_wins: ClassVar[bool] = True

    @classmethod
    def build_env(cls) -> Env:
        raise NotImplementedError

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str] | None:
        """A sequence of replies that solves the episode just reset with `seed`; None if not known."""
        return None

    @classmethod
    def illegal_actions(cls, env: Any, seed: int) -> list[str]:
        """Well-formed replies that are illegal in the state just reset with `seed`."""
        return []

    @classmethod
    def stalling_action(cls, env: Any) -> str:
        """A reply that never ends an episode (default: one that is not an action)."""
        return "???"

    # ---- helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def check_info(info: Any) -> None:
        assert isinstance(info, dict), f"info must be a dict, got {type(info).__name__}"
        for key in ("success", "invalid_action"):
            assert key in info, f"info lacks {key!r}: {sorted(info)}"
            assert isinstance(info[key], bool), f"info[{key!r}] must be a bool, got {type(info[key]).__name__}"
        assert isinstance(info.get("state"), str), f"info['state'] must be a str, got {info.get('state')!r:.80}"
        for key in ("tool_calls", *INFO_COUNTERS):  # counts roll sums per episode: whole numbers >= 0
            if key in info:
                assert isinstance(info[key], int) and info[key] >= 0, (
                    f"info[{key!r}] must be an int >= 0: {info[key]!r}"
                )

    @staticmethod
    def observation_text(obs: Any) -> str:
        """The text of an observation (text, or text with pictures that must load); asserts its form."""
        assert isinstance(obs, (str, dict)), f"observation must be a str or a text+images dict, got {type(obs)}"
        text = text_of(normalize(obs))  # raises on a malformed dict or a picture that does not load
        text.encode("utf-8")  # a tokenizer must be able to read it (no lone surrogates echoed back)
        return text

    @classmethod
    def observation_key(cls, obs: Any) -> tuple[str, ...]:
        """Text and picture digests: what tells two observations apart."""
        from roll_core.multimodal import digest

        norm = normalize(obs)
        return (text_of(norm), *(digest(im) for im in images_of(norm)))

    def checked_step(self, env: Env, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        out = env.step(action)
        assert isinstance(out, tuple) and len(out) == 5, "step must return (obs, reward, terminated, truncated, info)"
        obs, reward, terminated, truncated, info = out
        self.observation_text(obs)
        assert isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward)
        assert isinstance(terminated, bool) and isinstance(truncated, bool)
        self.check_info(info)
        return out

    def fingerprint(self, env: Env, seed: int) -> tuple[tuple[str, ...], ...]:
        obs, _ = env.reset(seed=seed)
        return tuple(self.observation_key(o) for o in (obs, *(env.step(a)[0] for a in self.probe_actions)))

    # ---- the contract -------------------------------------------------------------------------------------
    def test_satisfies_protocol(self) -> None:
        env = self.build_env()
        assert isinstance(env, Env)
        obs, info = env.reset(seed=self.seeds[0])
        assert self.observation_text(obs).strip(), "the first observation must have non-empty text"
        self.check_info(info)
        assert info["success"] is False and info["invalid_action"] is False

    def test_reset_is_deterministic(self) -> None:
        a, b = self.build_env(), self.build_env()
        for seed in self.seeds:
            assert self.fingerprint(a, seed) == self.fingerprint(b, seed), f"seed {seed} gave two instances"
        first = self.fingerprint(a, self.seeds[0])
        for action in [*MALFORMED[:3], self.stalling_action(a)]:  # an episode in between changes nothing
            a.step(action)
        assert self.fingerprint(a, self.seeds[0]) == first
        distinct = {self.fingerprint(a, seed) for seed in range(20)}
        assert len(distinct) >= self.min_distinct, f"only {len(distinct)} distinct instances in 20 seeds"

    def test_malformed_and_illegal_replies_are_invalid(self) -> None:
        env = self.build_env()
        seed = self.seeds[0]
        env.reset(seed=seed)
        replies = [*MALFORMED, *self.illegal_actions(env, seed)]
        for reply in replies:
            _, info0 = env.reset(seed=seed)
            obs, reward, terminated, _, info = self.checked_step(env, reply)
            shown = repr(reply[:40])
            assert info["invalid_action"] is True, f"{shown} was not marked invalid"
            assert not terminated and not info["success"], f"{shown} ended the episode"
            assert info["state"] == info0["state"], f"{shown} changed the state"
            assert reward <= 0, f"{shown} was rewarded {reward}"
            assert self.observation_text(obs).strip(), "an invalid action's observation must say what a valid action is"
            penalty = getattr(env, "invalid_penalty", None)
            if penalty is not None:
                assert reward == pytest.approx(penalty)

    def test_solving_sequence_succeeds(self) -> None:
        env = self.build_env()
        solved = 0
        for seed in self.seeds:
            env.reset(seed=seed)
            actions = self.solving_actions(env, seed)
            if actions is None:
                continue
            assert actions, f"seed {seed}: an empty solving sequence"
            total = 0.0
            for i, action in enumerate(actions):
                _, reward, terminated, truncated, info = self.checked_step(env, action)
                total += reward
                last = i == len(actions) - 1
                assert info["invalid_action"] is False, f"seed {seed}: step {i} ({action!r}) was invalid"
                assert terminated is last, f"seed {seed}: terminated={terminated} at step {i} of {len(actions)}"
                assert info["success"] is last, f"seed {seed}: success={info['success']} at step {i}"
                assert not truncated or last
            assert total > 0, f"seed {seed}: solving earned {total}"
            self.checked_step(env, actions[-1])  # stepping a finished episode must not raise
            solved += 1
        if not solved:
            pytest.skip("no solving sequence known for this environment")

    def test_step_limit_truncates(self) -> None:
        env = self.build_env()
        limit = getattr(env, "max_steps", None)
        if not isinstance(limit, int):
            pytest.skip("the environment has no max_steps")
        env.reset(seed=self.seeds[0])
        action = self.stalling_action(env)
        for i in range(1, limit + 1):
            _, _, terminated, truncated, _ = self.checked_step(env, action)
            assert not terminated, f"the stalling action {action!r} ended the episode at step {i}"
            assert truncated is (i == limit), f"truncated={truncated} at step {i} of max_steps={limit}"
        _, reward, terminated, truncated, _ = self.checked_step(env, action)  # after the end: no raise
        assert truncated and not terminated and reward == 0

    def test_close(self) -> None:
        """The env manager closes instances it drops and all of them at the end, reset or not (Env's docs)."""
        fresh = self.build_env()
        if not callable(getattr(fresh, "close", None)):
            pytest.skip("the environment has no close()")
        fresh.close()
        env = self.build_env()
        env.reset(seed=self.seeds[0])
        self.checked_step(env, self.stalling_action(env))
        env.close()

    def test_instructions(self) -> None:
        env = self.build_env()
        if not isinstance(env, EnvWithInstructions):
            pytest.skip("the environment provides no instructions()")
        text = env.instructions()
        assert isinstance(text, str) and len(text.strip()) > 20, f"instructions too short: {text!r}"

    def test_expert_wins(self) -> None:
        env = self.build_env()
        if not callable(getattr(env, "expert_reply", None)) or not self.expert_always_wins:
            pytest.skip("the environment has no expert that always wins")
        limit = getattr(env, "max_steps", 100)
        for seed in self.seeds:
            env.reset(seed=seed)
            info: dict[str, Any] = {}
            for turn in range(limit):
                reply = env.expert_reply()
                if reply is None and turn == 0 and seed == self.seeds[0]:
                    pytest.skip("expert_reply() gives None: the environment has no expert")
                assert isinstance(reply, str) and reply, f"seed {seed}: expert_reply() gave {reply!r}"
                _, _, terminated, truncated, info = self.checked_step(env, reply)
                assert not info["invalid_action"], f"seed {seed}: the expert's {reply!r} was invalid"
                if terminated or truncated:
                    break
            assert info.get("success") is True, f"seed {seed}: the expert did not win"
