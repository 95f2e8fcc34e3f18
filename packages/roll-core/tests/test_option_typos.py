"""A misspelt config option (`algo=grpoo`) is an error naming the closest option, as a misspelt key is; the options
listed are the ones a user can pick (roll_core.config.compose.explain)."""

from __future__ import annotations

import pytest

from roll_core.config.compose import compose
from roll_core.errors import ConfigError


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("algo=grpoo", "algo=grpo"),
        ("model=tny", "model=tiny"),
        ("experiment=quickstrt", "experiment=quickstart"),
        ("env/reward=mth", "env/reward=math"),  # a nested group (it was read as group 'env', option 'reward')
    ],
)
def test_a_misspelt_option_names_the_closest_one_and_lists_no_schema(override: str, hint: str) -> None:
    """Only plugin groups (engines, envs) said "did you mean"; every group's list also offered its schema
    (`algo_schema`), which is no option to pick."""
    with pytest.raises(ConfigError) as err:
        compose([override])
    msg = str(err.value)
    assert f"Did you mean '{hint}'?" in msg and "_schema" not in msg, msg
    assert "Installed env plugins" not in msg  # env/reward is not the env group
    assert msg.count("Did you mean") == 1


def test_an_option_nothing_resembles_gets_the_list_only() -> None:
    with pytest.raises(ConfigError) as err:
        compose(["algo=zzz"])
    assert "Available options in 'algo':\n\tasyppo" in str(err.value) and "Did you mean" not in str(err.value)
