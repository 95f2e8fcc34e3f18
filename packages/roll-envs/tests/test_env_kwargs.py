"""A misspelt `env.env_kwargs` key is a ConfigError naming `env.env_kwargs.<key>` and what the environment takes: it
was a bare TypeError from the environment's constructor ("unexpected keyword argument") when the pipeline was built."""

from __future__ import annotations

import sys
import types

import pytest

from roll_core.errors import ConfigError
from roll_envs.agentic.task import AgenticTask


def test_a_misspelt_builtin_env_kwarg_names_the_key_and_the_accepted_arguments() -> None:
    with pytest.raises(ConfigError) as err:
        AgenticTask("sokoban", env_kwargs={"widht": 8})
    msg = str(err.value)
    assert msg.startswith("env.env_kwargs.widht: sokoban takes no argument 'widht' (did you mean width?)")
    assert "it takes: width, height, num_boxes" in msg


def test_accepted_kwargs_build_the_task() -> None:
    task = AgenticTask("frozen_lake", env_kwargs={"size": 4}, eval_size=2)
    assert task.make_env() is not None


class _Needs:
    def __init__(self, level: int, *, fast: bool = False) -> None:
        self.level, self.fast = level, fast


def test_a_py_env_class_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("roll_test_env_kwargs_mod")
    module.Needs = _Needs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    task = AgenticTask.__new__(AgenticTask)
    task.env, task.env_kwargs = f"py:{module.__name__}:Needs", {"levl": 2}
    with pytest.raises(ConfigError, match=r"env\.env_kwargs\.levl: .* \(did you mean level\?\); it takes: level, fast"):
        task.make_env()
    task.env_kwargs = {"fast": True}
    with pytest.raises(ConfigError, match=r"env\.env_kwargs: .* needs level \(\+env\.env_kwargs\.level=<value>\)"):
        task.make_env()
    task.env_kwargs = {"level": 3}
    assert task.make_env().level == 3


def test_a_constructor_taking_any_keyword_is_left_to_itself() -> None:
    def factory(**kwargs: object) -> object:
        return kwargs

    from roll_envs.agentic.task import check_env_kwargs

    check_env_kwargs(factory, {"anything": 1}, "py:m:F")  # no error: the constructor passes them on
