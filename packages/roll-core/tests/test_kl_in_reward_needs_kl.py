"""`algo.kl_in_reward=true` with `algo.kl_coef=0` is refused: it subtracts 0 x KL from the token rewards (and no
reference model is loaded), so a user who asked for a KL penalty in the reward trained without one, unsaid. The
exception is adv_estimator=reinforce_pp, whose preset puts its KL in the reward and is switched off with
`algo.kl_coef=0` (as `algo.kl_kind` is kept there): every shipped preset with `algo.kl_coef=0` still composes."""

from __future__ import annotations

import pytest

from roll_core.config import ConfigError, compose, to_object
from roll_core.config.schema import AlgoConfig
from roll_core.config.search_path import group_options

REFUSED = (
    r"algo\.kl_in_reward=true subtracts algo\.kl_coef x KL from the token rewards, but algo\.kl_coef=0 subtracts "
    r"nothing .*: set algo\.kl_coef > 0 \(e\.g\. 0\.001\) for a KL penalty in the reward, or algo\.kl_in_reward=false"
)


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp_baseline"])
def test_kl_in_reward_without_a_coefficient_is_refused(estimator: str) -> None:
    with pytest.raises(ValueError, match=REFUSED):
        AlgoConfig(adv_estimator=estimator, group_size=2, kl_in_reward=True, kl_coef=0.0)
    assert AlgoConfig(adv_estimator=estimator, group_size=2, kl_in_reward=True, kl_coef=0.01).kl_in_reward


def test_a_composed_ppo_with_kl_in_reward_and_no_coefficient_is_refused() -> None:
    with pytest.raises(ConfigError, match=REFUSED):
        to_object(compose(["algo=ppo", "algo.kl_in_reward=true"]))
    algo = to_object(compose(["algo=ppo", "algo.kl_in_reward=true", "algo.kl_coef=0.001"])).algo
    assert (algo.kl_in_reward, algo.kl_coef, algo.use_reference) == (True, 0.001, True)


def test_reinforce_pp_switches_its_kl_off_with_a_zero_coefficient() -> None:
    algo = to_object(compose(["algo=reinforce_pp", "algo.kl_coef=0"])).algo
    assert (algo.kl_in_reward, algo.kl_coef, algo.use_reference) == (True, 0.0, False)


@pytest.mark.parametrize("preset", sorted(group_options("algo")))
def test_every_preset_with_kl_switched_off_still_composes(preset: str) -> None:
    assert to_object(compose([f"algo={preset}", "algo.kl_coef=0"])).algo.kl_coef == 0
