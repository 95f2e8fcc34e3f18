"""Empty and missing observations of third-party environments (GymTextEnv, GemEnv, SkyRLEnv), and the env manager
over them: an observation None reached the model as the text "None", an info "state" None became the state
"None", an empty first observation (or a SkyRL row whose prompt is empty, or one message outside a list, read as
the list of its keys) asked the model nothing, and a SkyRL step with no observation went on without a word."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from roll_core.agentic.env_manager import EnvFailure, EnvManager
from roll_envs.agentic import GymTextEnv, make_env

sys.path.insert(0, str(Path(__file__).parent))  # adapter_stand_ins, shared with test_adapter_contract_checks.py
from adapter_stand_ins import gem, gym, scripted


@pytest.mark.parametrize("build", [gym, gem])
def test_a_none_observation_is_an_error_but_at_the_end(build: Any) -> None:
    """`str(None)`: the model was shown "None" as its task or as the environment's answer."""
    with pytest.raises(ValueError, match=r"Scripted.*: reset returned the observation None"):
        build(reset=(None, {})).reset(seed=0)
    env = build((None, 0.0, False, False, {}))
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"Scripted.*: step returned the observation None"):
        env.step("a")
    # On the step that ends the episode no turn reads it: the empty observation, and the state with it.
    for terminated, truncated in [(True, False), (False, True)]:
        env = build((None, 1.0, terminated, truncated, {}))
        env.reset(seed=0)
        obs, reward, term, trunc, info = env.step("a")
        assert (obs, reward, term, trunc) == ("", 1.0, terminated, truncated) and info["state"] == ""


@pytest.mark.parametrize("build", [gym, gem])
def test_an_info_state_of_none_reads_as_absent(build: Any) -> None:
    """info["state"] None became the state "None": every such step one state to GiGPO's grouping."""
    _, info = build(reset=("first", {"state": None})).reset(seed=0)
    assert info["state"] == "first"
    env = build(("second", 0.0, False, False, {"state": None}))
    env.reset(seed=0)
    assert env.step("a")[4]["state"] == "second"
    env = build(("second", 0.0, False, False, {"state": 7}))  # a state that is not text is its text
    env.reset(seed=0)
    assert env.step("a")[4]["state"] == "7"


@pytest.mark.parametrize("build", [gym, gem])
def test_an_empty_first_observation_is_an_error(build: Any) -> None:
    """The first observation is the whole task (GEM states its rules there): "" asked the model nothing."""
    for empty in ("", "  \n"):
        with pytest.raises(ValueError, match="reset returned the empty observation"):
            build(reset=(empty, {})).reset(seed=0)
    env = build(("", 0.0, False, False, {}))  # later, an empty observation is one (an empty user turn)
    env.reset(seed=0)
    assert env.step("a")[:4] == ("", 0.0, False, False)


def test_gym_obs_to_text_must_return_text() -> None:
    """A converter returning None or a dict was passed on: the env manager read None as "None" and a dict as an
    observation with pictures."""
    for bad in (None, {"text": "x"}, 3):
        env = GymTextEnv(scripted(("o", 0.0, False, False, {})), obs_to_text=lambda obs, bad=bad: bad)
        with pytest.raises(ValueError, match=f"obs_to_text returned {type(bad).__name__}"):
            env.reset(seed=0)
    # A None observation that ends the episode never reaches the converter (it expects the environment's own).
    env = GymTextEnv(scripted((None, 1.0, True, False, {}), reset=(2, {})), obs_to_text=lambda n: "x" * n)
    assert env.reset(seed=0)[0] == "xx" and env.step("a")[0] == ""


def test_the_env_manager_fails_an_adapters_none_observation_as_an_env_error() -> None:
    m = EnvManager(lambda: gem((None, 0.0, False, False, {})), 1, step_timeout_s=30.0)
    m.reset(0, seed=0)
    with pytest.raises(EnvFailure) as err:
        m.step(0, "a")
    assert err.value.kind == "env_error" and "observation None" in str(err.value)
    m.close()


ROWS = [{"prompt": "What is 2 + 3? End with #### ANSWER.", "extras": {"reward_spec": {"ground_truth": "5"}}}]


def _skyrl(
    monkeypatch: pytest.MonkeyPatch,
    steps: list[Any] | None = None,
    init: Any = None,
    rows: list[dict[str, Any]] | None = None,
    max_turns: int = 3,
) -> Any:
    """A SkyRLEnv over a registered SkyRL-Gym environment whose steps (in turn) and init return what the test
    sets (init None: the prompt messages, recorded in `seen`)."""
    skyrl_gym = pytest.importorskip("skyrl_gym", exc_type=ImportError)
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    script = list(steps or [])

    class Scripted(BaseTextEnv):
        seen: ClassVar[list[Any]] = []

        def __init__(self, env_config: Any = None, extras: Any = None) -> None:
            super().__init__()
            self.max_turns = max_turns

        def init(self, prompt: Any) -> Any:
            Scripted.seen.append(prompt)
            if isinstance(init, Exception):
                raise init
            return (prompt, {}) if init is None else init

        def step(self, action: str) -> Any:
            return script.pop(0)

    registration = skyrl_gym.envs.registration
    registry = {k: v for k, v in registration.registry.items() if k != "roll_test_empty"}
    monkeypatch.setattr(registration, "registry", registry)
    skyrl_gym.register(id="roll_test_empty", entry_point=Scripted)
    env = make_env("skyrl:roll_test_empty", rows=rows or ROWS)
    env.scripted = Scripted
    return env


def test_skyrl_rows_that_ask_nothing_are_refused_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty prompt reached the model as an empty first message; a prompt of one message (not in a list) was
    read as the list of its keys, so the model was asked "role\\n\\ncontent"; extras None raised a bare TypeError."""
    pytest.importorskip("skyrl_gym", exc_type=ImportError)
    for prompt, why in [
        ("", "row 2's prompt is blank"),
        ("  \n", "row 2's prompt is blank"),
        ([], "row 2's prompt is list"),
        ([{"role": "user", "content": " "}], "row 2's prompt has no message with text"),
        (["What is 2 + 3?"], "not a chat message"),
        (7, "row 2's prompt is int"),
    ]:
        with pytest.raises(ValueError, match=rf"SkyRLEnv\(roll_test_empty\) rows: 1 rows cannot .*{why}"):
            _skyrl(monkeypatch, rows=[ROWS[0], {**ROWS[0], "prompt": prompt}])
    with pytest.raises(ValueError, match=r"eval_rows: 1 rows cannot start an episode: row 1's extras 3"):
        make_env("skyrl:roll_test_empty", rows=ROWS, eval_rows=[{"prompt": "Q?", "extras": 3}])
    # One message is a prompt of one message; extras None are none.
    message = {"role": "user", "content": "What is 2 + 3?"}
    env = _skyrl(monkeypatch, rows=[{"prompt": message, "extras": None}])
    assert env.reset(seed=0)[0] == "What is 2 + 3?" and env.scripted.seen[-1] == [message]


def test_skyrl_an_init_with_no_text_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment's init returning no messages (or empty ones) started an episode on an empty prompt."""
    for messages in ([], "", [{"role": "user", "content": ""}], None):
        env = _skyrl(monkeypatch, init=(messages, {}))
        with pytest.raises(ValueError, match=r"'roll_test_empty': init returned no text for seed 0's row"):
            env.reset(seed=0)


def test_skyrl_a_step_after_a_failed_reset_never_reaches_the_new_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reset whose init raised left the last episode's "not done": the next step went to an environment whose
    init never ran."""
    env = _skyrl(monkeypatch, steps=[{"observations": [{"role": "user", "content": "Go on."}], "reward": 0, "done": 0}])
    env.reset(seed=0)
    env.step("#### 4")  # the episode goes on
    env._make = lambda *a, **k: type("Broken", (env.scripted,), {"init": lambda self, p: 1 / 0})()
    with pytest.raises(ZeroDivisionError):
        env.reset(seed=1)
    obs, reward, terminated, truncated, _ = env.step("#### 5")
    assert obs.startswith("The episode is over") and (reward, terminated, truncated) == (0.0, False, True)


def test_skyrl_a_step_with_no_observation_is_an_empty_turn_counted_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SkyRL-Gym's search environment goes on with no observation when its tool finds nothing: the model's next
    turn follows an empty user message, counted and logged once; an episode that ends with none reads as over."""
    nothing = [[], "", None, [{"role": "user", "content": ""}]]
    steps = [{"observations": o, "reward": 0.0, "done": False} for o in nothing]
    steps.append({"observations": [], "reward": 1.0, "done": True})
    env = _skyrl(monkeypatch, steps=steps, max_turns=10)
    with caplog.at_level(logging.WARNING):
        env.reset(seed=0)
        for _ in nothing:
            assert env.step("#### 4")[:4] == ("", 0.0, False, False)
        assert env.step("#### 5")[:4] == ("The episode is over.", 1.0, True, False)
    assert env.empty_observations == 4
    assert caplog.text.count("returned no observation on a step that does not end the episode") == 1
    # Through the env manager: the empty observation is returned as "", the episode goes on to its end.
    steps = [{"observations": [], "reward": 0.0, "done": False}, {"observations": [], "reward": 1.0, "done": True}]
    m = EnvManager(lambda: _skyrl(monkeypatch, steps=list(steps), max_turns=10), 1, step_timeout_s=30.0)
    assert m.reset(0, seed=0)[0] == ROWS[0]["prompt"]
    assert m.step(0, "#### 4")[:4] == ("", 0.0, False, False)
    assert m.step(0, "#### 5")[:4] == ("The episode is over.", 1.0, True, False)
    assert m.counters()["env_errors"] == 0
    m.close()
