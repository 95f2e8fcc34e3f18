"""Pairs of algo options, each valid alone: the config refuses the pairs where one silently defeats the other, and the
RL objective computes the pairs it accepts as documented (hand-computed on small tensors, fake roles, no model).

Refused: a dual clip with a policy loss that has no clipped surrogate (cispo, tis, topr, vanilla ignored it), DAPO
dynamic sampling with groups of one (every group is uniform: each step sampled refill_max_batches batches and trained on
nothing), and a setting the chosen built-in estimator or loss never reads (gamma < 1 with grpo, dr_grpo, rloo, or
reinforce_pp on trajectories; lam < 1 with anything but gae; a non-default clip range with tis, topr, vanilla; a non-
default ratio_cap with anything but tis; critic_lr or value_clip without a critic; kl_horizon
without the adaptive controller; off_policy_cap without truncated IS); the lists of what ignores what are checked
against the estimators and losses themselves, and an out-of-tree estimator or loss is never refused. Computed: KL in the
reward with reinforce_pp (the trainer's old log-probs, not the engine's, and no KL loss beside it), an off-policy
correction under several epochs and mini-batches (weights of the recomputed proximal log-probs over the engine's,
computed once), and whitening after GRPO (a uniform group is re-centred).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from roll_algos import corrections
from roll_algos.advantages import discounted_returns, whiten
from roll_algos.corrections import CORRECTIONS, correction_weights
from roll_algos.losses import (
    NO_CLIP_RANGE,
    NO_DUAL_CLIP,
    NO_RATIO_CAP,
    POLICY_LOSS_VARIANTS,
    off_policy_weights,
    policy_loss,
)
from roll_core import registry
from roll_core.algorithms import NO_GAMMA, NO_GAMMA_TRAJECTORIES, NO_LAM, load_estimator
from roll_core.config import ConfigError, compose, to_object
from roll_core.config import algo as algo_module
from roll_core.config.schema import AlgoConfig
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.rl import RLObjective
from roll_core.protocol import Batch
from roll_core.testing.estimators import outcome_inputs, trajectory_inputs

# ---------------------------------------------------------------- refused pairs


@pytest.mark.parametrize("variant", NO_DUAL_CLIP)
def test_dual_clip_is_refused_with_a_loss_that_has_no_clipped_surrogate(variant: str) -> None:
    with pytest.raises(ValueError, match=rf"policy_loss={variant} has none and would ignore it: set algo.dual_clip="):
        AlgoConfig(policy_loss=variant, dual_clip=3.0)
    AlgoConfig(policy_loss=variant)  # without a dual clip: fine


@pytest.mark.parametrize("variant", ["ppo", "gspo"])
def test_dual_clip_is_kept_with_the_clipped_losses(variant: str) -> None:
    assert AlgoConfig(policy_loss=variant, dual_clip=3.0).dual_clip == 3.0


def test_the_ppo_preset_with_a_reinforce_loss_names_the_dual_clip() -> None:
    with pytest.raises(ConfigError, match=r"algo\.dual_clip=3\.0 .*algo\.policy_loss=cispo"):
        to_object(compose(["algo=ppo", "algo.policy_loss=cispo"]))  # the preset sets dual_clip: 3.0


def test_dynamic_sampling_needs_groups_of_two() -> None:
    with pytest.raises(ConfigError, match=r"algo\.drop_uniform_groups=true .*group_size=1 never does"):
        to_object(compose(["algo=ppo", "algo.drop_uniform_groups=true"]))  # ppo: group_size 1
    with pytest.raises(ValueError, match=r"group_size >= 2, or drop_uniform_groups=false"):
        AlgoConfig(adv_estimator="reinforce_pp", group_size=1, drop_uniform_groups=True)
    assert AlgoConfig(adv_estimator="reinforce_pp", group_size=2, drop_uniform_groups=True).drop_uniform_groups


BUILT_IN_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "gigpo", "turn_grpo")


@pytest.mark.parametrize("estimator", NO_GAMMA)
def test_a_discount_is_refused_with_an_estimator_that_never_discounts(estimator: str) -> None:
    with pytest.raises(
        ValueError, match=rf"algo\.gamma=0\.9 .*adv_estimator={estimator} never reads it: set algo\.gamma=1"
    ):
        AlgoConfig(adv_estimator=estimator, gamma=0.9)
    AlgoConfig(adv_estimator=estimator, gamma=1.0)


@pytest.mark.parametrize("estimator", NO_LAM)
def test_a_gae_lambda_is_refused_with_any_estimator_but_gae(estimator: str) -> None:
    with pytest.raises(
        ValueError, match=rf"algo\.lam=0\.95 .*adv_estimator={estimator} never reads it: set algo\.lam=1"
    ):
        AlgoConfig(adv_estimator=estimator, lam=0.95)


@pytest.mark.parametrize("estimator", sorted(set(BUILT_IN_ESTIMATORS) - set(NO_GAMMA)))
def test_a_discount_is_kept_by_the_estimators_that_read_it(estimator: str) -> None:
    assert AlgoConfig(adv_estimator=estimator, gamma=0.9).gamma == 0.9


@pytest.mark.parametrize("variant", NO_CLIP_RANGE)
@pytest.mark.parametrize("key", ["clip_low", "clip_high"])
def test_a_clip_range_is_refused_with_a_loss_that_never_clips_the_ratio(variant: str, key: str) -> None:
    with pytest.raises(
        ValueError, match=rf"algo\.{key}=0\.28 .*policy_loss={variant} never reads it: set algo\.{key}=0\.2"
    ):
        AlgoConfig(policy_loss=variant, **{key: 0.28})
    AlgoConfig(policy_loss=variant, **{key: 0.2})  # the default every config carries: fine


@pytest.mark.parametrize("variant", NO_RATIO_CAP)
def test_a_ratio_cap_is_refused_with_any_loss_but_tis(variant: str) -> None:
    with pytest.raises(
        ValueError, match=rf"algo\.ratio_cap=1\.5 .*policy_loss={variant} never reads it: set algo\.ratio_cap=2\.0"
    ):
        AlgoConfig(policy_loss=variant, ratio_cap=1.5)


def test_the_settings_are_kept_where_they_are_read() -> None:
    assert AlgoConfig(adv_estimator="gae", gamma=0.9, lam=0.95).lam == 0.95
    assert AlgoConfig(policy_loss="tis", ratio_cap=1.5).ratio_cap == 1.5
    for variant in ("ppo", "gspo", "cispo"):
        assert AlgoConfig(policy_loss=variant, clip_low=0.1, clip_high=0.28).clip_high == 0.28


def test_presets_switched_to_a_loss_or_estimator_that_ignores_their_settings_name_them() -> None:
    with pytest.raises(ConfigError, match=r"algo\.clip_high=0\.28 .*algo\.policy_loss=topr never reads it"):
        to_object(compose(["algo=dapo", "algo.policy_loss=topr"]))  # dapo's clip-higher
    with pytest.raises(ConfigError, match=r"algo\.clip_low=0\.0003 .*algo\.policy_loss=tis never reads it"):
        to_object(compose(["algo=gspo", "algo.policy_loss=tis"]))  # gspo's sequence-ratio clip range
    with pytest.raises(ConfigError, match=r"algo\.gamma=0\.99 .*algo\.adv_estimator=grpo never reads it"):
        to_object(compose(["algo=grpo", "algo.gamma=0.99"]))
    with pytest.raises(ConfigError, match=r"algo\.lam=0\.95 .*algo\.adv_estimator=rloo never reads it"):
        to_object(compose(["algo=rloo", "algo.lam=0.95"]))


NO_CRITIC = sorted(set(BUILT_IN_ESTIMATORS) - {"gae"})


@pytest.mark.parametrize("estimator", NO_CRITIC)
@pytest.mark.parametrize(("key", "value", "default"), [("critic_lr", 5e-6, 1e-05), ("value_clip", 0.5, 0.2)])
def test_critic_settings_are_refused_without_a_critic(estimator: str, key: str, value: float, default: float) -> None:
    with pytest.raises(
        ValueError,
        match=rf"algo\.{key}={value} configures the critic .*adv_estimator={estimator} trains none and never reads it: "
        rf"set algo\.{key}={default}",
    ):
        AlgoConfig(adv_estimator=estimator, **{key: value})
    AlgoConfig(adv_estimator=estimator, **{key: default})  # the default every config carries: fine


def test_a_disabled_value_clip_is_refused_without_a_critic_too() -> None:
    with pytest.raises(ValueError, match=r"algo\.value_clip=None configures the critic .*adv_estimator=grpo"):
        AlgoConfig(value_clip=None)
    assert AlgoConfig(adv_estimator="gae", group_size=1, value_clip=None).value_clip is None


@pytest.mark.parametrize(
    "overrides", [[], ["algo.kl_in_reward=true", "algo.adv_estimator=reinforce_pp"]], ids=["kl_off", "in_reward_coef_0"]
)
def test_a_kl_kind_is_kept_when_kl_is_switched_off(overrides: list[str]) -> None:
    """algo.kl_coef=0 is how a preset's KL is switched off: the preset's kind must not make that an error."""
    assert to_object(compose([*overrides, "algo.kl_kind=k1"])).algo.kl_kind == "k1"
    assert to_object(compose([*overrides, "algo.kl_kind=k1", "algo.kl_coef=0.01"])).algo.kl_kind == "k1"


def test_a_kl_horizon_is_refused_without_the_adaptive_controller() -> None:
    for kl in ({}, {"kl_coef": 0.01}):  # KL off, and a fixed coefficient: neither has a horizon
        with pytest.raises(
            ValueError, match=r"algo\.kl_horizon=500 .*kl_target=null .*nothing reads it: set algo\.kl_horizon=10000"
        ):
            AlgoConfig(kl_horizon=500, **kl)
    assert AlgoConfig(kl_horizon=500, kl_coef=0.01, kl_target=0.05).kl_horizon == 500


@pytest.mark.parametrize("correction", [None, *CORRECTIONS])
def test_an_off_policy_cap_is_refused_without_truncated_is(correction: str | None) -> None:
    with pytest.raises(
        ValueError,
        match=rf"algo\.off_policy_cap=3\.0 .*off_policy_correction={correction} never reads it: "
        r"set algo\.off_policy_cap=2\.0",
    ):
        AlgoConfig(off_policy_correction=correction, off_policy_cap=3.0)
    AlgoConfig(off_policy_correction=correction, off_policy_cap=2.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_an_off_policy_cap_is_kept_and_read_by_truncated_is(level: str) -> None:
    assert AlgoConfig(off_policy_correction=level, off_policy_cap=3.0).off_policy_cap == 3.0
    old, behaviour, mask = torch.tensor([[0.0, 0.0]]), torch.tensor([[-5.0, -5.0]]), torch.ones(1, 2)
    assert torch.equal(off_policy_weights(old, behaviour, mask, level=level, cap=3.0), torch.full((1, 2), 3.0))


def test_the_masking_corrections_never_read_the_cap() -> None:
    """What makes off_policy_cap ignored with them: correction_weights takes no cap, only the band's bounds."""
    assert "cap" not in inspect.signature(correction_weights).parameters
    for name in CORRECTIONS:
        assert "cap" not in inspect.signature(getattr(corrections, name)).parameters


def test_the_presets_keep_their_critic_and_kl_settings() -> None:
    for preset in ("ppo", "asyppo"):
        algo = to_object(compose([f"algo={preset}", "algo.critic_lr=3e-3", "algo.value_clip=0.5"])).algo
        assert (algo.critic_lr, algo.value_clip) == (3e-3, 0.5)
    assert to_object(compose(["algo=reinforce_pp"])).algo.kl_kind == "k1"
    with pytest.raises(ConfigError, match=r"algo\.critic_lr=0\.003 .*algo\.adv_estimator=grpo trains none"):
        to_object(compose(["algo=ppo", "algo.adv_estimator=grpo", "algo.group_size=2", "algo.critic_lr=3e-3"]))
    assert to_object(compose(["algo=reinforce_pp", "algo.kl_coef=0"])).algo.kl_coef == 0  # KL switched off


def test_an_out_of_range_value_is_said_before_it_is_called_ignored() -> None:
    with pytest.raises(ValueError, match=r"algo\.ratio_cap=0\.0 must be > 0"):
        AlgoConfig(ratio_cap=0.0)
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        AlgoConfig(gamma=2.0)


def test_out_of_tree_estimators_and_losses_are_never_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin may read any of these settings: only roll's own names are known to ignore them."""
    choices = algo_module.algo_choices()
    plugged = {
        **choices,
        "adv_estimator": (*choices["adv_estimator"], "my_estimator"),
        "policy_loss": (*choices["policy_loss"], "my_loss"),
    }
    monkeypatch.setattr(algo_module, "algo_choices", lambda: plugged)
    cfg = AlgoConfig(
        adv_estimator="my_estimator", policy_loss="my_loss", gamma=0.9, lam=0.95, ratio_cap=1.5, clip_high=0.28
    )
    assert (cfg.gamma, cfg.lam, cfg.ratio_cap, cfg.clip_high) == (0.9, 0.95, 1.5, 0.28)
    # the objective hands a plugin estimator `algo`: it may read the critic, KL and cap settings too
    cfg = AlgoConfig(
        adv_estimator="my_estimator", critic_lr=5e-6, value_clip=0.5, kl_kind="k1", kl_horizon=500, off_policy_cap=3.0
    )
    assert (cfg.critic_lr, cfg.value_clip, cfg.kl_kind, cfg.kl_horizon, cfg.off_policy_cap) == (
        5e-6,
        0.5,
        "k1",
        500,
        3.0,
    )


def test_reinforce_pp_on_trajectories_refuses_a_discount_it_never_reads() -> None:
    for name in NO_GAMMA_TRAJECTORIES:
        with pytest.raises(ConfigError, match=rf"algo\.gamma=0\.9 .*adv_estimator={name} on trajectory batches"):
            load_estimator(name, trajectories=True, gamma=0.9)
        load_estimator(name, trajectories=True, gamma=1.0)
    load_estimator("reinforce_pp", trajectories=False, gamma=0.9)  # outcome batches discount the token rewards
    for name in ("gigpo", "turn_grpo"):
        load_estimator(name, trajectories=True, gamma=0.9)


def _estimate(name: str, trajectories: bool, gamma: float, lam: float) -> torch.Tensor:
    est = registry.load("roll.algorithms", name)
    if trajectories:
        x, _ = trajectory_inputs(with_turns=bool(getattr(est, "needs_turns", False)))
    else:
        x = outcome_inputs(with_values=True)
    algo = SimpleNamespace(group_size=4, gamma=gamma, lam=lam, norm_mean_type=None, norm_std_type=None)
    return est(x, algo)[0]


@pytest.mark.parametrize("name", BUILT_IN_ESTIMATORS)
def test_the_lists_of_estimators_that_ignore_gamma_and_lam_are_what_the_estimators_do(name: str) -> None:
    assert set(BUILT_IN_ESTIMATORS) <= set(registry.available("roll.algorithms"))
    est = registry.load("roll.algorithms", name)
    if not getattr(est, "needs_turns", False):
        base = _estimate(name, False, 1.0, 1.0)
        assert torch.equal(_estimate(name, False, 0.5, 1.0), base) == (name in NO_GAMMA), "gamma, outcome batch"
        assert torch.equal(_estimate(name, False, 1.0, 0.5), base) == (name in NO_LAM), "lam, outcome batch"
    if getattr(est, "trajectories", True):
        base = _estimate(name, True, 1.0, 1.0)
        assert torch.equal(_estimate(name, True, 0.5, 1.0), base) == (name in NO_GAMMA_TRAJECTORIES), (
            "gamma, trajectories"
        )
        assert torch.equal(_estimate(name, True, 1.0, 0.5), base), "lam on trajectories (only gae reads it; no form)"


@pytest.mark.parametrize("variant", POLICY_LOSS_VARIANTS)
def test_the_lists_of_losses_that_ignore_the_clip_range_and_ratio_cap_are_what_the_losses_do(variant: str) -> None:
    logp = -torch.linspace(0.1, 2.4, 24).reshape(4, 6)
    old = logp - torch.tensor([-1.2, -0.5, 0.7, 1.1])[:, None]  # each row's ratio (gspo's too): 0.3, 0.6, 2.0, 3.0
    adv, mask = torch.tensor([1.0, -1.0]).repeat(4, 3), torch.ones(4, 6)  # both signs in every row

    def loss(**kw: float) -> torch.Tensor:
        return policy_loss(logp, old, adv, mask, variant=variant, **kw)[0]

    base = loss()
    assert torch.equal(loss(clip_low=0.1), base) == (variant in NO_CLIP_RANGE)
    assert torch.equal(loss(clip_high=0.4), base) == (variant in NO_CLIP_RANGE)
    assert torch.equal(loss(ratio_cap=1.2), base) == (variant in NO_RATIO_CAP)


# ---------------------------------------------------------------- accepted pairs, by hand


class _Actor:
    """compute_logprobs returns `old` (or `ref` for the LoRA base); train records what it was given."""

    def __init__(self, old: torch.Tensor, ref: torch.Tensor) -> None:
        self.old, self.ref, self.trained = old, ref, None

    def compute_logprobs(self, batch: Batch, temperature: float, base: bool = False) -> dict[str, torch.Tensor]:
        return {"logprobs": (self.ref if base else self.old).clone()}

    def train(self, batch: Batch, objective, **kwargs):
        self.trained = (batch, objective, kwargs)
        return {}


MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
LAST = torch.tensor([[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0]], dtype=torch.float32)
BEHAVIOUR = torch.tensor([[-0.5, -1.0, -0.2, 0.0], [-2.0, 0, 0, 0], [-0.1, -0.3, -0.7, -1.2], [-0.4, -0.9, 0, 0]])
OLD = BEHAVIOUR + torch.tensor([[0.1, -0.9, 0.0, 0.0], [0.3, 0, 0, 0], [-0.2, 0.05, 0.8, -0.1], [0.0, 0.2, 0, 0]])
REF = OLD + torch.tensor([[0.4, -0.2, 0.1, 0.0], [-0.3, 0, 0, 0], [0.2, 0.2, -0.5, 0.3], [0.1, -0.1, 0, 0]])


def _update(overrides: list[str], scores: list[float], *, lora: bool = False):
    cfg = to_object(compose(["algo.group_size=2", "pipeline.rollout_batch_size=2", *overrides]))
    actor = _Actor(OLD, REF)
    reference = _Actor(REF, REF) if cfg.algo.use_reference and not lora else None
    roles = SimpleNamespace(
        actor_train=actor,
        reference=reference,
        reference_is_base=lora and cfg.algo.use_reference,
        critic=None,
        critics=[],
        sampling=SimpleNamespace(temperature=1.0),
        mini_batches=max(cfg.algo.num_mini_batches, 1),
    )
    batch = Batch(
        {
            "response_mask": MASK,
            "behaviour_logprobs": BEHAVIOUR,
            "input_ids": torch.zeros(4, 6, dtype=torch.long),
            "responses": torch.zeros(4, 4, dtype=torch.long),
            "attention_mask": torch.ones(4, 6, dtype=torch.long),
        }
    )
    out = StepLog()
    RLObjective(cfg, roles, trajectories=False).update(0, Collected(batch, torch.tensor(scores)), out)  # type: ignore[arg-type]
    return actor.trained, out


def test_kl_in_reward_subtracts_the_trainers_k1_from_the_token_rewards_and_adds_no_kl_loss() -> None:
    (batch, objective, _), out = _update(["algo=reinforce_pp", "algo.kl_coef=0.1"], [1.0, 0.0, 1.0, 0.0])
    rewards = LAST * torch.tensor([1.0, 0.0, 1.0, 0.0])[:, None] - 0.1 * (OLD - REF) * MASK  # k1 of the trainer's
    want = whiten(discounted_returns(rewards, MASK, gamma=1.0), MASK)
    torch.testing.assert_close(batch["advantages"], want * MASK)
    assert objective.kl_loss_coef == 0.0 and out["actor/kl_coef"] == 0.1  # counted once: in the reward


def test_a_correction_under_epochs_and_mini_batches_weighs_the_proximal_over_the_behaviour_policy() -> None:
    overrides = ["algo.off_policy_correction=token", "algo.ppo_epochs=2", "algo.num_mini_batches=2"]
    (batch, _, kwargs), _ = _update(overrides, [1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(batch["old_logprobs"], OLD)  # the ratio's denominator: recomputed, not the engine's
    torch.testing.assert_close(batch["is_weights"], torch.exp(OLD - BEHAVIOUR).clamp(max=2.0) * MASK)
    assert (kwargs["epochs"], kwargs["mini_batches"]) == (2, 2)


def test_whitening_after_grpo_recentres_a_uniform_group_on_the_batch_token_mean() -> None:
    (batch, _, _), _ = _update(["algo.whiten_advantages=true"], [1.0, 0.0, 1.0, 1.0])
    grpo = torch.tensor([2**-0.5, -(2**-0.5), 0.0, 0.0])[:, None] * MASK  # group 2 all correct: advantage 0
    want = whiten(grpo, MASK)
    torch.testing.assert_close(batch["advantages"], want * MASK)
    mean = float((grpo * MASK).sum() / MASK.sum())  # (3 - 1) / sqrt(2) / 10 tokens > 0
    assert mean > 0 and bool((batch["advantages"][2:][MASK[2:].bool()] < 0).all())  # the solved prompt is pushed down


def test_lora_reference_is_the_actors_base_in_the_kl_loss() -> None:
    (batch, objective, _), out = _update(["algo.kl_coef=0.1"], [1.0, 0.0, 1.0, 1.0], lora=True)
    torch.testing.assert_close(batch["ref_logprobs"], REF)
    assert objective.kl_loss_coef == 0.1 and "actor/kl_to_ref" in out
