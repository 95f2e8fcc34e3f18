"""What third-party environments return is checked by roll's adapters (GymTextEnv, GemEnv, SkyRLEnv) as roll's env
manager checks roll's own: `bool()` read the string "False" as True, `float()` read "1.0" and NaN as rewards, an
old-Gym reset was split into (observation, info), a Mapping info that is not a dict lost its success flag, and a
single-turn SkyRL-Gym environment's wrong answer was reported as a truncation."""

from __future__ import annotations

import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from roll_envs.agentic import make_env

sys.path.insert(0, str(Path(__file__).parent))  # adapter_stand_ins, shared with test_adapter_empty_observations.py
from adapter_stand_ins import gem, gym


@pytest.mark.parametrize("build", [gym, gem])
def test_flags_that_are_not_bools_are_refused(build: Any) -> None:
    """A terminated flag "False" read as True (the episode ended on a step the environment said goes on)."""
    env = build(("obs", 0.0, "False", False, {}))
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"_Scripted'|Scripted-v0'.*terminated flag 'False'; it must be a bool"):
        env.step("a")
    for bad in (None, 2, 0.5, "no"):
        env = build(("obs", 0.0, False, bad, {}))
        env.reset(seed=0)
        with pytest.raises(ValueError, match="truncated flag"):
            env.step("a")
    # Bools, 0/1 and NumPy bools are read.
    for terminated, truncated in [(np.bool_(True), np.bool_(False)), (1, 0), (np.int64(1), False)]:
        env = build(("obs", 1.0, terminated, truncated, {}))
        env.reset(seed=0)
        _, reward, term, trunc, info = env.step("a")
        assert (reward, term, trunc, info["success"]) == (1.0, True, False, True)
        assert type(term) is bool and type(trunc) is bool


@pytest.mark.parametrize("build", [gym, gem])
def test_rewards_that_are_not_finite_numbers_are_refused(build: Any) -> None:
    for bad in ("1.0", None, float("nan"), float("inf"), np.float32("nan"), 10**400):
        env = build(("obs", bad, False, False, {}))
        env.reset(seed=0)
        with pytest.raises(ValueError, match="rewards must be finite real numbers"):
            env.step("a")
    env = build(("obs", np.float32(0.5), False, False, {}))
    env.reset(seed=0)
    reward = env.step("a")[1]
    assert reward == 0.5 and type(reward) is float


@pytest.mark.parametrize("build", [gym, gem])
def test_resets_and_steps_of_the_wrong_shape_are_refused(build: Any) -> None:
    """An old-Gym reset returning only its observation: a 2-element one was split into (observation, info) silently
    (observation 3, info dropped), others raised a bare unpacking error."""
    for bad in ((3, 4), 0, "ab", ("obs", {}, 1), ("obs", "info")):
        with pytest.raises(ValueError, match="reset returns a 2-tuple"):
            build(reset=bad).reset(seed=0)
    obs, info = build(reset=["obs", None]).reset(seed=0)  # a list, and no info, are read
    assert obs == "obs" and info["success"] is False and info["state"] == "obs"
    env = build(("obs", 1.0, True, {}))  # an old-Gym (obs, reward, done, info)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="step returned 4 values"):
        env.step("a")
    env = build(("obs", 1.0, True, False, ["not", "a", "dict"]))
    env.reset(seed=0)
    with pytest.raises(ValueError, match="its info is list"):
        env.step("a")


@pytest.mark.parametrize("build", [gym, gem])
def test_mapping_infos_are_read_and_their_flags_checked(build: Any) -> None:
    """An info that is a Mapping but not a dict was dropped with its success flag; a "success" of "False" read True."""
    env = build(("obs", 0.0, True, False, MappingProxyType({"success": True, "state": "s1"})))
    env.reset(seed=0)
    _, _, _, _, info = env.step("a")
    assert info["success"] is True and info["state"] == "s1"
    env = build(("obs", 0.0, True, False, {"is_success": np.float32(1.0), "invalid_action": np.bool_(False)}))
    env.reset(seed=0)
    info = env.step("a")[4]
    assert info["success"] is True and info["invalid_action"] is False
    env = build(("obs", 1.0, True, False, {"success": None}))  # None reads as absent: the reward fallback
    env.reset(seed=0)
    assert env.step("a")[4]["success"] is True
    for key in ("success", "is_success", "invalid_action"):
        env = build(("obs", 0.0, True, False, {key: "False"}))
        env.reset(seed=0)
        with pytest.raises(ValueError, match=rf"info\[\"{key}\"\] flag 'False'"):
            env.step("a")
    with pytest.raises(ValueError, match=r"info\[\"success\"\] flag"):
        build(reset=("obs", {"success": "yes"})).reset(seed=0)


SINGLE_TURN_ROWS = [
    {"prompt": "What is 2 + 3? End with #### ANSWER.", "extras": {"reward_spec": {"ground_truth": "5"}}}
]


def test_a_single_turn_skyrl_environments_wrong_answer_is_terminated() -> None:
    """SkyRL-Gym's gsm8k (max_turns 1, SkyRL-Gym's default) ends after its one answer: a wrong one is its terminal
    state, and it read as a truncation (every failure of a single-turn task counted as truncated)."""
    pytest.importorskip("skyrl_gym", exc_type=ImportError)
    env = make_env("skyrl:gsm8k", rows=SINGLE_TURN_ROWS)
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("#### 6")
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("#### 5")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    env.reset(seed=0)  # a reply with no answer (never stepped) is still the turn limit's end
    assert env.step("<think>#### 5")[2:4] == (False, True)


def test_a_multi_turn_skyrl_environments_last_wrong_turn_is_still_truncated() -> None:
    pytest.importorskip("skyrl_gym", exc_type=ImportError)
    rows = [{**SINGLE_TURN_ROWS[0], "extras": {"reward_spec": {"ground_truth": "5"}, "max_turns": 2}}]
    env = make_env("skyrl:gsm8k_multi_turn", rows=rows)
    env.reset(seed=0)
    assert env.step("#### 6")[2:4] == (False, False)
    assert env.step("#### 7")[2:4] == (False, True)


def _skyrl(monkeypatch: pytest.MonkeyPatch, step: Any, init: Any = None) -> Any:
    """A SkyRLEnv over a registered SkyRL-Gym environment whose step (and init) return what the test sets."""
    skyrl_gym = pytest.importorskip("skyrl_gym", exc_type=ImportError)
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    class Scripted(BaseTextEnv):
        def __init__(self, env_config: Any = None, extras: Any = None) -> None:
            super().__init__()
            self.max_turns = 3

        def init(self, prompt: Any) -> Any:
            return (prompt, {}) if init is None else init

        def step(self, action: str) -> Any:
            return step

    registration = skyrl_gym.envs.registration
    # the test's env is removed after (and replaced by the next call's)
    registry = {k: v for k, v in registration.registry.items() if k != "roll_test_scripted"}
    monkeypatch.setattr(registration, "registry", registry)
    skyrl_gym.register(id="roll_test_scripted", entry_point=Scripted)
    return make_env("skyrl:roll_test_scripted", rows=SINGLE_TURN_ROWS)


def test_skyrl_step_outputs_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bool(out["done"])` read "False" as done, `float(out["reward"])` of None raised a bare TypeError."""
    name = "SkyRL-Gym environment 'roll_test_scripted'"
    for out, error in [
        ({"observations": [], "reward": 0.0, "done": "False"}, "'done' flag 'False'"),
        ({"observations": [], "reward": None, "done": False}, "rewards must be finite"),
        ({"observations": [], "reward": float("nan"), "done": True}, "rewards must be finite"),
        ({"observations": [], "done": True}, "a mapping with 'observations', 'reward' and 'done'"),
        (("obs", 1.0, True), "a mapping with 'observations', 'reward' and 'done'"),
        ({"observations": [3], "reward": 0.0, "done": False}, "is not a chat message"),
        ({"observations": [{"content": {"x": 1}}], "reward": 0.0, "done": False}, "is not a chat message"),
        ({"observations": 7, "reward": 0.0, "done": False}, "are not a list of chat messages"),
    ]:
        env = _skyrl(monkeypatch, out)
        env.reset(seed=0)
        with pytest.raises(ValueError, match=rf"{name}: .*{error}"):
            env.step("#### 5")
    env = _skyrl(monkeypatch, {"observations": [], "reward": np.float32(1.0), "done": np.bool_(True)})
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("#### 5")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert type(reward) is float and type(terminated) is bool
    # One message outside a list, strings, and OpenAI text parts are read.
    observations = [{"role": "user", "content": [{"type": "text", "text": "Wrong."}, "Again."]}, "2 left."]
    env = _skyrl(monkeypatch, {"observations": observations, "reward": 0.0, "done": 0})
    env.reset(seed=0)
    assert env.step("#### 6")[:4] == ("Wrong.\nAgain.\n\n2 left.", 0.0, False, False)
    env = _skyrl(monkeypatch, {"observations": {"role": "user", "content": "Wrong."}, "reward": 0, "done": False})
    env.reset(seed=0)
    assert env.step("#### 6")[0] == "Wrong."


def test_skyrl_init_must_return_messages_and_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """An init returning the messages alone: two messages were split into (first message, second message)."""
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for bad in (two, two[:1], "Hi", ("Hi", "metadata")):
        env = _skyrl(monkeypatch, {}, init=bad)
        with pytest.raises(
            ValueError, match=r"'roll_test_scripted': init returned .*must return \(messages, metadata\)"
        ):
            env.reset(seed=0)
    assert _skyrl(monkeypatch, {}, init=(two, None)).reset(seed=0)[0] == "Be brief.\n\nHi"
