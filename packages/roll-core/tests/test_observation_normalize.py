"""`observation.normalize` converts only what its docstring lists (text, numbers, UTF-8 bytes, text-with-pictures
dicts); anything else is a ValueError (the env manager's counted env_error), where its repr used to reach the model
as the observation's text (`b'...'`, `['a', 'b']`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from roll_core.agentic.env_manager import EnvFailure, EnvManager
from roll_core.agentic.observation import normalize


def test_the_documented_conversions() -> None:
    assert normalize("a") == "a"
    assert normalize("héllo".encode()) == "héllo"
    assert normalize(bytearray(b"row 1\nrow 2")) == "row 1\nrow 2"
    assert normalize(3) == "3" and normalize(2.5) == "2.5" and normalize(np.int64(7)) == "7"
    assert normalize({"text": "t"}) == "t" and normalize({"text": "t", "images": []}) == "t"


@pytest.mark.parametrize(
    "obs, why",
    [
        (b"\xff\xfe", "must be UTF-8 text"),
        (["a", "b"], "got list"),
        (("a",), "got tuple"),
        ({"a"}, "got set"),
        (True, "got bool"),
        (np.zeros(2), "got ndarray"),
        (object(), "got object"),
        ({}, "needs its 'text'"),
        ({"images": []}, "needs its 'text'"),
        ({"text": b"x"}, "'text' must be a str"),
        ({"text": "x", "meta": 1}, "got also ['meta']"),
    ],
)
def test_anything_else_is_a_clear_error(obs: Any, why: str) -> None:
    with pytest.raises(ValueError) as err:
        normalize(obs)
    assert why in str(err.value)


class _Returns:
    def __init__(self, step_obs: Any) -> None:
        self.step_obs = step_obs

    def reset(self, seed: int | None = None) -> Any:
        return b"start", {}

    def step(self, action: str) -> Any:
        return self.step_obs, 0.0, False, False, {}


def test_the_env_manager_counts_a_list_observation_as_an_env_error() -> None:
    m = EnvManager(lambda: _Returns(["x", "y"]), 1, step_timeout_s=30.0)
    try:
        assert m.reset(0, seed=0)[0] == "start"  # UTF-8 bytes: their text
        with pytest.raises(EnvFailure) as err:
            m.step(0, "a")
        assert err.value.kind == "env_error" and m.counters()["env_errors"] == 1
        assert "got list" in str(err.value)
    finally:
        m.close()
