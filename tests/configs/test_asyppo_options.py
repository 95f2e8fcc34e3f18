"""The asyppo preset and algo.num_critics / critic_model_path / critic_agree_fraction / critic_disagree_fraction:
composed and validated (no model, no Ray); and which rows each critic of an ensemble trains on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.config import ConfigError, compose, to_object
from roll_core.config.schema import AlgoConfig
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.critics import Critics
from roll_core.protocol import Batch


def algo(*overrides: str) -> AlgoConfig:
    return to_object(compose(list(overrides))).algo


def test_asyppo_preset_is_gae_with_two_critics_and_both_masks() -> None:
    a = algo("algo=asyppo")
    assert (a.adv_estimator, a.num_critics, a.critic_model_path) == ("gae", 2, None)
    assert (a.critic_agree_fraction, a.critic_disagree_fraction, a.entropy_coef) == (0.1, 0.2, 0.001)
    assert a.use_critic and a.group_size % a.num_critics == 0
    smaller = algo("algo=asyppo", "algo.critic_model_path=builtin:tiny", "algo.num_critics=4")
    assert (smaller.critic_model_path, smaller.num_critics) == ("builtin:tiny", 4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_critics": 0}, r"num_critics=0 must be >= 1"),
        ({"adv_estimator": "grpo", "num_critics": 2}, r"critics of adv_estimator=gae"),
        ({"adv_estimator": "grpo", "critic_model_path": "x"}, r"critics of adv_estimator=gae"),
        ({"adv_estimator": "gae", "num_critics": 3, "group_size": 8}, r"group_size=8 must be a multiple"),
        ({"adv_estimator": "gae", "critic_agree_fraction": 0.1}, r"set algo.num_critics >= 2"),
        ({"adv_estimator": "gae", "num_critics": 2, "critic_agree_fraction": 1.0}, r"must lie in \[0, 1\)"),
        ({"adv_estimator": "gae", "num_critics": 2, "critic_disagree_fraction": 0.2}, r"set entropy_coef > 0"),
    ],
)
def test_unusable_critic_settings_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**fields)


def test_an_override_error_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"algo.critic_disagree_fraction=0.2 filters the entropy bonus"):
        algo("algo=asyppo", "algo.entropy_coef=0")


class _Recorder:
    """A critic worker group's surface (compute_values, train) that remembers the rows it trained on."""

    def __init__(self, offset: float) -> None:
        self.offset = offset
        self.trained: list[Batch] = []

    def compute_values(self, batch: Batch) -> Batch:
        r = batch["response_mask"].shape[1]
        return Batch({"values": batch["row"].float().unsqueeze(-1).repeat(1, r) + self.offset})

    def train(self, batch: Batch, loss: Any, **kwargs: Any) -> dict[str, float]:
        self.trained.append(batch)
        return {"critic/vf_loss": float(len(batch)), "grad_norm": 1.0}


def test_each_critic_trains_on_its_own_share_of_every_group_with_its_own_values() -> None:
    groups = [_Recorder(0.0), _Recorder(10.0)]
    cfg = AlgoConfig(adv_estimator="gae", group_size=4, num_critics=2)
    critics = Critics(groups, cfg)
    batch = Batch({"row": torch.arange(8), "response_mask": torch.ones(8, 3)})  # two prompts of four responses
    out = StepLog()
    mean = critics.values(batch, batch["response_mask"], out)
    assert mean[:, 0].tolist() == [r + 5.0 for r in range(8)]  # the mean of row and row + 10
    assert out["critic/ensemble_std_mean"] == pytest.approx(5.0)
    critics.train(batch, SimpleNamespace(), out, mini_batches=1, epochs=1, temperature=1.0, shuffle_seed=0)
    seen = [g.trained[0]["row"].tolist() for g in groups]
    assert seen == [[0, 2, 4, 6], [1, 3, 5, 7]]  # disjoint, and two responses of each prompt for each critic
    # Each trains against its own old values (the value clip's reference), not the ensemble mean.
    assert groups[1].trained[0]["values"][:, 0].tolist() == [11.0, 13.0, 15.0, 17.0]
    assert (out["critic_0/vf_loss"], out["critic_1/vf_loss"], out["critic/vf_loss"]) == (4.0, 4.0, 4.0)
    assert out["critic_0/grad_norm"] == 1.0 and out["critic_1/rows"] == 4.0


def test_a_single_critics_engine_metrics_go_under_critic() -> None:
    """One critic (PPO): its engine's own metrics (grad norm, learning rate, optimizer steps) are logged as
    critic/<name> like the several critics' critic_<m>/<name>, never as bare top-level keys."""
    critics = Critics([_Recorder(0.0)], AlgoConfig(adv_estimator="gae", group_size=4))
    batch = Batch({"row": torch.arange(4), "response_mask": torch.ones(4, 3)})
    out = StepLog()
    critics.values(batch, batch["response_mask"], out)
    critics.train(batch, SimpleNamespace(), out, mini_batches=1, epochs=1, temperature=1.0, shuffle_seed=0)
    assert out["critic/vf_loss"] == 4.0 and out["critic/grad_norm"] == 1.0
    assert "grad_norm" not in out


def test_the_entropy_bonus_leaves_out_the_filtered_tokens_only() -> None:
    from roll_core.pipelines.losses import PolicyObjective

    logp = torch.zeros(1, 4, requires_grad=True)
    ent = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    micro = {
        "response_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        "advantages": torch.zeros(1, 4),
        "entropy_mask": torch.tensor([[1.0, 0.0, 1.0, 0.0]]),
    }
    loss, metrics = PolicyObjective(entropy_coef=0.5)({"logprobs": logp, "entropy": ent}, micro)
    # token-mean over the 3 response tokens, the 2nd counting 0: -0.5 * (1 + 3) / 3; the logged entropy is unmasked.
    assert float(loss.detach()) == pytest.approx(-0.5 * 4 / 3)
    assert float(metrics["actor/entropy"]) == pytest.approx(2.0)
    loss.backward()
    assert ent.grad[0].tolist() == pytest.approx([-0.5 / 3, 0.0, -0.5 / 3, 0.0])


def test_ray_colocated_runs_refuse_more_device_roles_than_a_bundle_fits() -> None:
    from roll_core.pipelines.objectives import RoleNeeds
    from roll_core.pipelines.wiring import _check_colocated_share

    def check(*overrides: str) -> None:
        cfg = to_object(compose(["algo=asyppo", "cluster=ray", *overrides]))
        _check_colocated_share(cfg, RoleNeeds(critic=True, reference=True), reference_built=cfg.algo.kl_coef > 0)

    check("algo.kl_coef=0.01")  # actor_train, actor_infer, reference, critic, critic_1: five fit
    check("algo.num_critics=3", "algo.group_size=6")  # no reference: actor_train, actor_infer and three critics
    with pytest.raises(ConfigError, match=r"fits 5 device roles per device, this run has 7 \(.*critic_3\)"):
        check("algo.num_critics=4", "algo.kl_coef=0.01")
    check("algo.num_critics=4", "algo.kl_coef=0.01", "cluster.placement=disaggregated")
    # Distillation's teachers take one slot each, critic or not (the sixth actor used to wait forever).
    cfg = to_object(compose(["cluster=ray"]))
    four = {name: "builtin:tiny" for name in ("a", "b", "c", "d")}
    _check_colocated_share(cfg, RoleNeeds(teachers=dict(list(four.items())[:3])), reference_built=False)
    with pytest.raises(ConfigError, match=r"this run has 6 \(actor_train, actor_infer, teacher_a, .*teacher_d\)"):
        _check_colocated_share(cfg, RoleNeeds(teachers=four), reference_built=False)
