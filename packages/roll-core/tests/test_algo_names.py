"""The names `algo.*` accepts are defined once, where they are implemented: roll-algos' lists (KL kinds, policy
losses, aggregation modes) and the installed `roll.algorithms` entry points (estimators). roll-core keeps no copy
(a copy of the KL kinds once lacked `mse`, so `algo.kl_kind=mse` was refused although roll-algos computes it)."""

from __future__ import annotations

import pytest
import torch

from roll_algos.kl import KL_KINDS, kl_estimate
from roll_algos.losses import AGG_MODES, POLICY_LOSS_VARIANTS, aggregate, policy_loss
from roll_core import registry
from roll_core.config import schema
from roll_core.config.schema import AlgoConfig, algo_choices


def test_kl_kind_mse_is_accepted() -> None:
    assert AlgoConfig(kl_kind="mse", kl_coef=0.1).kl_kind == "mse"


def test_choices_are_roll_algos_lists_and_installed_estimators() -> None:
    assert algo_choices() == {
        "adv_estimator": tuple(registry.available("roll.algorithms")),
        "policy_loss": POLICY_LOSS_VARIANTS,
        "loss_agg": AGG_MODES,
        "kl_kind": KL_KINDS,
    }
    assert {"grpo", "gae", "gigpo", "turn_grpo"} <= set(algo_choices()["adv_estimator"])
    # No second list in roll-core to drift.
    for copy in ("KL_KINDS", "POLICY_LOSSES", "LOSS_AGGS", "ADV_ESTIMATORS"):
        assert not hasattr(schema, copy), copy


@pytest.mark.parametrize("key", ["adv_estimator", "policy_loss", "loss_agg", "kl_kind"])
def test_every_listed_name_validates_and_others_are_refused(key: str) -> None:
    for name in algo_choices()[key]:
        assert getattr(AlgoConfig(**{key: name}), key) == name
    with pytest.raises(ValueError, match=rf"algo\.{key}='nope' is not one of '{algo_choices()[key][0]}'"):
        AlgoConfig(**{key: "nope"})


def test_every_listed_name_is_implemented() -> None:
    """The lists are the implementations' own: each name computes (an unknown one raises in roll-algos)."""
    g = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(2, 5, generator=g), -torch.rand(2, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    for kind in KL_KINDS:
        assert torch.isfinite(kl_estimate(logp, ref, kind)).all()
    for mode in AGG_MODES:
        assert torch.isfinite(aggregate(logp, mask, mode, norm_length=5))
    adv = torch.tensor([1.0, -1.0])
    for variant in POLICY_LOSS_VARIANTS:
        loss, _ = policy_loss(logp, ref, adv, mask, variant=variant)
        assert torch.isfinite(loss)
    for name in registry.available("roll.algorithms"):
        assert callable(registry.load("roll.algorithms", name))


def test_the_outcome_reward_sits_on_the_last_trained_token_of_a_trajectory() -> None:
    """A multi-turn mask has holes (observation tokens): the reward goes on the last generated token, not at the
    index of the count of valid tokens (it landed on an observation token, or inside the last turn)."""
    import torch

    from roll_core.algorithms import token_rewards_from_scores

    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0], [0] * 10], dtype=torch.float)
    got = token_rewards_from_scores(torch.tensor([1.0, 2.0, 3.0]), mask)
    want = torch.zeros(3, 10)
    want[0, 7], want[1, 2] = 1.0, 2.0
    assert torch.equal(got, want)
