"""algo.off_policy_correction's masking choices with their bounds, algo.norm_mean_type / norm_std_type, and the
lite_ppo preset: composed and validated (no model, no Ray), and the estimator reading the normalisation choices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from roll_core.algorithms import AdvantageInputs, dr_grpo, grpo
from roll_core.config import ConfigError, compose, to_object
from roll_core.config.schema import AlgoConfig


def algo(*overrides: str):
    return to_object(compose(list(overrides))).algo


def test_lite_ppo_preset_is_group_mean_batch_std_token_mean_without_critic() -> None:
    a = algo("algo=lite_ppo")
    assert (a.adv_estimator, a.norm_mean_type, a.norm_std_type, a.loss_agg) == ("grpo", "group", "batch", "token-mean")
    assert not a.use_critic and not a.use_reference


@pytest.mark.parametrize("name", ["token_mask", "sequence_mask", "icepop", "geo_mask"])
def test_every_masking_correction_validates_with_default_and_given_bounds(name: str) -> None:
    assert AlgoConfig(off_policy_correction=name).correction_low is None
    a = AlgoConfig(off_policy_correction=name, correction_low=0.9, correction_high=1.1)
    assert (a.correction_low, a.correction_high) == (0.9, 1.1)


def test_an_override_reaches_the_typed_config() -> None:
    a = algo("algo.off_policy_correction=geo_mask", "algo.correction_high=1.01")
    assert (a.off_policy_correction, a.correction_low, a.correction_high) == ("geo_mask", None, 1.01)
    with pytest.raises(ConfigError, match=r"icepop bounds \[1.5, 5.0\] must be"):  # as a config error, naming keys
        algo("algo.off_policy_correction=icepop", "algo.correction_low=1.5")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"off_policy_correction": "geo_mask", "correction_high": 0.99}, r"0 < low <= 1 <= high"),
        ({"off_policy_correction": "token_mask", "correction_low": 0.0}, r"0 < low <= 1 <= high"),
        ({"off_policy_correction": "token", "correction_high": 3.0}, r"bound the masking.*off_policy_cap"),
        ({"correction_low": 0.5}, r"bound the masking corrections"),
        ({"off_policy_correction": "clip"}, r"algo.off_policy_correction='clip' is not one of.*'icepop'"),
        ({"norm_std_type": "running"}, r"algo.norm_std_type='running' is not one of"),
        ({"adv_estimator": "gae", "norm_std_type": "batch"}, r"adv_estimator=gae normalises its own way"),
        ({"adv_estimator": "rloo", "norm_mean_type": "batch"}, r"grpo and dr_grpo"),
    ],
)
def test_bad_choices_say_what_to_do(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**fields)


def test_the_estimators_read_the_normalisation_choices() -> None:
    # Scores [1, 0, 1, 1 | 0, 0, 0, 1], G = 4: group means 0.75 / 0.25, group stds 0.5, batch std sqrt(2/7).
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    mask = torch.ones(8, 2)
    x = AdvantageInputs(scores, torch.zeros(8, 2), mask)

    def ns(mean: str | None, std: str | None) -> SimpleNamespace:
        return SimpleNamespace(group_size=4, norm_mean_type=mean, norm_std_type=std)

    def first(adv: tuple[torch.Tensor, None]) -> float:  # row 0's advantage (on each of its tokens)
        return round(float(adv[0][0, 0]), 5)

    assert first(grpo(x, ns(None, None))) == 0.5  # GRPO: 0.25 / 0.5
    assert first(dr_grpo(x, ns(None, None))) == 0.25  # Dr.GRPO: 0.25
    assert first(grpo(x, ns("group", "batch"))) == round(0.25 / (2 / 7) ** 0.5, 5)  # Lite PPO: 0.467707
    assert first(dr_grpo(x, ns(None, "batch"))) == round(0.25 / (2 / 7) ** 0.5, 5)  # std chosen, mean default
    assert first(grpo(x, ns("batch", "none"))) == 0.5  # 1 - 0.5
    adv, _ = grpo(x, ns("group", "batch"))
    assert torch.equal(adv[:, 0], adv[:, 1])  # on every token of the row


def test_trajectory_batches_refuse_the_normalisation_choices() -> None:
    from roll_core.pipelines.objectives.rl import RLObjective

    cfg = to_object(compose(["algo.norm_std_type=batch"]))
    with pytest.raises(ConfigError, match=r"outcome batches of consecutive groups \(pipeline=rlvr\)"):
        RLObjective(cfg, None, trajectories=True)  # type: ignore[arg-type]  (refused before any role is read)


def test_kl_in_reward_is_refused_for_trajectory_batches_and_kl_target_needs_a_start() -> None:
    """reinforce_pp's trajectory path scores whole episodes: a KL subtracted from token rewards would be dropped
    (no penalty anywhere); an adaptive KL coefficient starting at 0 never moves."""
    from roll_core.pipelines.objectives.distill import check_algo as check_distill_algo
    from roll_core.pipelines.objectives.rl import RLObjective

    cfg = to_object(compose(["algo.adv_estimator=reinforce_pp", "algo.kl_in_reward=true", "algo.kl_coef=0.1"]))
    with pytest.raises(ConfigError, match=r"trajectory batches \(pipeline=agentic\) score whole episodes"):
        RLObjective(cfg, None, trajectories=True)  # type: ignore[arg-type]  (refused before any role is read)
    # reinforce_pp's preset with its KL switched off (kl_coef=0) drops nothing: accepted on trajectory batches
    off = to_object(compose(["algo=reinforce_pp", "algo.kl_coef=0"]))
    assert off.algo.kl_in_reward and not off.algo.use_reference
    with pytest.raises(AttributeError):  # past the KL check: the (absent) roles are read next
        RLObjective(off, None, trajectories=True)  # type: ignore[arg-type]
    check_distill_algo(off)  # the same for distillation's check
    with pytest.raises(ConfigError, match=r"pipeline=distill: algo\.kl_in_reward=true needs token rewards"):
        check_distill_algo(cfg)
    with pytest.raises(ConfigError, match=r"algo\.kl_target=0\.05 adapts algo\.kl_coef from its value"):
        to_object(compose(["algo.kl_target=0.05", "algo.kl_coef=0"]))
    to_object(compose(["algo.kl_target=0.05", "algo.kl_coef=0.01"]))


def test_masked_nan_log_probs_never_reach_the_kl_gradient() -> None:
    """Padding may hold NaN: the KL loss (k2, whose gradient multiplies by the log-ratio) stays finite."""
    from roll_core.pipelines.losses import PolicyObjective

    logp = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)
    micro = {
        "old_logprobs": torch.tensor([[-1.1, -1.9, 0.0]]),
        "advantages": torch.tensor([[1.0, 1.0, 1.0]]),
        "ref_logprobs": torch.tensor([[-1.2, -2.2, float("inf")]]),
        "response_mask": torch.tensor([[1, 1, 0]]),
    }
    for kind in ("k1", "k2", "k3", "mse"):
        logp.grad = None
        loss, _ = PolicyObjective(kl_loss_coef=0.1, kl_kind=kind)({"logprobs": logp}, micro)
        loss.backward()
        assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0, (kind, logp.grad)
