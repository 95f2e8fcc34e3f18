"""A misspelt `env.env_kwargs` key is refused when the config is validated (`to_object`: what `roll-train --cfg job`
and a sweep's pre-check run), not only when the task is built at run start (after Ray is up). The check reads the
environment's constructor signature through the `roll.agentic_envs` registry (AgenticEnvConfig.__post_init__ in
roll-envs: roll-core never imports roll-envs) and builds no environment. A `py:<module>:<Class>` environment, and a
name that does not resolve, are left to the run (importing the user's module at validation is not done)."""

from __future__ import annotations

import functools

import pytest

from roll_core.config import ConfigError, compose, to_object
from roll_envs.agentic import sokoban

TYPO = r"env\.env_kwargs\.widht: sokoban takes no argument 'widht' \(did you mean width\?\); it takes: width, height"


def test_a_misspelt_env_kwarg_is_refused_by_the_config_check() -> None:
    with pytest.raises(ConfigError, match=TYPO):
        to_object(compose(["pipeline=agentic", "env=sokoban", "+env.env_kwargs.widht=8"]))


def test_roll_train_cfg_job_refuses_it() -> None:
    from roll_core.cli_dry_run import check_printed_config

    with pytest.raises(ConfigError, match=TYPO):
        check_printed_config(["pipeline=agentic", "env=sokoban", "+env.env_kwargs.widht=8", "--cfg", "job"])


def test_the_check_builds_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[dict[str, object]] = []
    init = sokoban.SokobanEnv.__init__

    @functools.wraps(init)
    def counting(self: object, *args: object, **kwargs: object) -> None:
        built.append(kwargs)
        init(self, *args, **kwargs)

    monkeypatch.setattr(sokoban.SokobanEnv, "__init__", counting)
    env = to_object(compose(["pipeline=agentic", "env=sokoban", "env.env_kwargs.width=7"])).env
    assert (env.env_kwargs["width"], built) == (7, [])
    with pytest.raises(ConfigError, match=TYPO):
        to_object(compose(["pipeline=agentic", "env=sokoban", "+env.env_kwargs.widht=8"]))
    assert built == []


@pytest.mark.parametrize("env", ["frozen_lake", "guess_number", "sokoban", "tool_math", "visual_frozen_lake"])
def test_the_shipped_agentic_options_pass(env: str) -> None:
    assert to_object(compose(["pipeline=agentic", f"env={env}"])).env.env_kwargs is not None


@pytest.mark.parametrize("name", ["py:roll_no_such_module_here:Maze", "no_such_environment"])
def test_what_does_not_resolve_without_importing_user_code_is_left_to_the_run(name: str) -> None:
    env = to_object(compose(["pipeline=agentic", "env=agentic", f"env.env={name}", "+env.env_kwargs.anything=1"])).env
    assert env.env_kwargs == {"anything": 1}
