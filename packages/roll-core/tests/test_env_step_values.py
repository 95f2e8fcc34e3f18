"""The env manager reads what an environment returns by the rule the third-party adapters use
(roll_core.agentic.step_values): where its own copy was looser, it read an info that is not a dict (a list of
pairs, 0, "" or False) as one, an info "success" of "False" as a success (the rollout's `bool()`), and an
observation None as the text "None"."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

from roll_core.agentic.env_manager import EnvFailure, EnvManager
from roll_core.agentic.step_values import checked_info, checked_observation, checked_reset, checked_step


class _Returns:
    """An environment whose reset and step return what the test sets."""

    def __init__(self, step: Any = None, reset: Any = ("start", {})) -> None:
        self.step_out, self.reset_out = step, reset

    def reset(self, seed: int | None = None) -> Any:
        return self.reset_out

    def step(self, action: str) -> Any:
        return self.step_out


def _failure(step: Any = None, reset: Any = ("start", {})) -> str:
    """The env_error message of the first call that fails (reset, else step), counted once."""
    m = EnvManager(lambda: _Returns(step, reset), 1, step_timeout_s=30.0)
    with pytest.raises(EnvFailure) as err:
        m.reset(0, seed=0)
        m.step(0, "a")
    assert err.value.kind == "env_error" and m.counters()["env_errors"] == 1
    m.close()
    return str(err.value)


@pytest.mark.parametrize("info", [[("success", True)], 0, "", False, "info", 5])
def test_an_info_that_is_not_a_dict_fails_its_episode(info: Any) -> None:
    assert f"its info is {type(info).__name__}" in _failure(("o", 1.0, True, False, info))


@pytest.mark.parametrize("key", ["success", "invalid_action"])
def test_an_info_flag_that_is_not_a_bool_fails_its_episode(key: str) -> None:
    """The rollout read `bool(info["success"])`: the string "False" was a success."""
    for bad in ("False", "yes", 2, [True]):
        assert f'info["{key}"] flag' in _failure(("o", 1.0, True, False, {key: bad}))
    assert f'info["{key}"] flag' in _failure(reset=("o", {key: "no"}))


def test_info_flags_are_read_as_bools() -> None:
    np = pytest.importorskip("numpy")
    m = EnvManager(lambda: _Returns(("o", 1.0, True, False, {"success": np.bool_(True), "invalid_action": 0})), 1)
    m.reset(0, seed=0)
    info = m.step(0, "a")[4]
    assert info == {"success": True, "invalid_action": False} and type(info["success"]) is bool
    m.close()
    assert checked_info(MappingProxyType({"success": 1.0, "invalid_action": None})) == {
        "success": True,
        "invalid_action": None,  # None reads as absent
    }


def test_a_none_observation_fails_but_on_the_step_that_ends_the_episode() -> None:
    """`normalize(None)` was the text "None": the model read it as its task or the environment's answer."""
    assert "reset returned the observation None" in _failure(reset=(None, {}))
    assert "step returned the observation None" in _failure((None, 0.0, False, False, {}))
    for terminated, truncated in [(True, False), (False, True)]:
        m = EnvManager(lambda t=terminated, u=truncated: _Returns((None, 1.0, t, u, None)), 1)
        m.reset(0, seed=0)
        assert m.step(0, "a") == ("", 1.0, terminated, truncated, {})
        m.close()


def test_the_shared_checks_name_the_environment() -> None:
    env = "GEM environment 'x'"
    for call, bad, why in [
        (checked_reset, "obs", "reset returned str"),
        (checked_step, ("o", 1.0, True, {}), "step returned 4 values"),
        (checked_step, ("o", 1.0, "no", False, {}), "step returned the terminated flag 'no'"),
        (checked_info, ["k"], "its info is list"),
        (checked_observation, None, "step returned the observation None"),
    ]:
        with pytest.raises(ValueError, match=f"^{env}: {why}"):
            call(bad, env)
    assert checked_step(["o", 1, 0, 1, None]) == ("o", 1.0, False, True, {})
    assert checked_reset(["o", None]) == ("o", {})
