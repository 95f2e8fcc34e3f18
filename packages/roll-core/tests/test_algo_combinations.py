"""Pairs of algo options, each valid alone: the config refuses the pairs where one silently defeats the other, and the
RL objective computes the pairs it accepts as documented (hand-computed on small tensors, fake roles, no model).

Refused: a dual clip with a policy loss that has no clipped surrogate (cispo, tis, topr, vanilla ignored it), and
DAPO dynamic sampling with groups of one (every group is uniform: each step sampled refill_max_batches batches and
trained on nothing). Computed: KL in the reward with reinforce_pp (the trainer's old log-probs, not the engine's, and
no KL loss beside it), an off-policy correction under several epochs and mini-batches (weights of the recomputed
proximal log-probs over the engine's, computed once), and whitening after GRPO (a uniform group is re-centred).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from roll_algos.advantages import discounted_returns, whiten
from roll_algos.losses import NO_DUAL_CLIP
from roll_core.config import ConfigError, compose, to_object
from roll_core.config.schema import AlgoConfig
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.rl import RLObjective
from roll_core.protocol import Batch

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
