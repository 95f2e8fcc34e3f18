"""What the critics log (roll_core.pipelines.objectives.critics): the value fit before the update
(`critic/explained_variance`, `critic/values_mean`, `critic/returns_mean`) and the same `critic/` keys for one critic
(PPO) as for an ensemble (AsyPPO), whose per-critic metrics are aggregated by a stated rule. No model, no Ray."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.config.schema import AlgoConfig
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.critics import Critics, merge_critic_metrics, value_fit_metrics
from roll_core.protocol import Batch

KWARGS = {"mini_batches": 1, "epochs": 1, "temperature": 1.0, "shuffle_seed": 0}


class _Critic:
    """A critic worker group's surface: fixed values, and the train metrics an engine and ValueObjective return."""

    def __init__(self, values: torch.Tensor, metrics: dict[str, float]) -> None:
        self.values, self.metrics = values, metrics

    def compute_values(self, batch: Batch) -> Batch:
        return Batch({"values": self.values[batch["row"]]})

    def train(self, batch: Batch, loss: Any, **kwargs: Any) -> dict[str, float]:
        return dict(self.metrics)


def engine_metrics(loss: float, grad_norm: float, lr: float, steps: float, seconds: float) -> dict[str, float]:
    return {
        "critic/vf_loss": loss,
        "critic/vf_clipfrac": 0.5,
        "grad_norm": grad_norm,
        "lr": lr,
        "optimizer_steps": steps,
        "nonfinite_steps": 0.0,
        "train_seconds": seconds,
        "scaler_skip_streak_max": steps,
    }


def step(critics: Critics, batch: Batch, returns: torch.Tensor) -> StepLog:
    """One RL step's critic part, as RLObjective.update runs it (values, GAE's returns, update)."""
    out = StepLog()
    batch["values"] = critics.values(batch, batch["response_mask"], out)
    batch["returns"] = returns
    critics.train(batch, SimpleNamespace(), out, **KWARGS)
    return out


def test_explained_variance_by_hand() -> None:
    """Returns 1, 2, 3, 4 and values 1, 2, 2, 5 on the four response tokens (the masked ones hold garbage, NaN
    included): residuals 0, 0, 1, -1, Var 0.5; Var(returns) 1.25; 1 - 0.5/1.25 = 0.6."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    returns = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, float("nan")]])
    values = torch.tensor([[1.0, 2.0, -7.0], [2.0, 5.0, 9.0]])
    got = value_fit_metrics(values, returns, mask)
    assert got == pytest.approx({"explained_variance": 0.6, "values_mean": 2.5, "returns_mean": 2.5})
    assert value_fit_metrics(returns.nan_to_num(), returns.nan_to_num(), mask)["explained_variance"] == 1.0


def test_equal_returns_report_no_explained_variance_and_no_token_reports_nothing() -> None:
    """Var(returns) = 0 (every response scored alike): x/0 is left out, never NaN, inf or an error, also when the
    returns differ by float rounding only; without a response token there is nothing to report."""
    mask = torch.ones(1, 3)
    got = value_fit_metrics(torch.tensor([[0.0, 1.0, 2.0]]), torch.full((1, 3), 0.1), mask)
    assert "explained_variance" not in got and got["returns_mean"] == pytest.approx(0.1)
    assert value_fit_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)) == {}
    # GAE's float32 returns of equal scores (advantages + values) differ by rounding only: equal, not Var ~1e-17
    values = torch.tensor([[0.1, 0.2, 0.3]])
    adv = (torch.zeros(1, 3) - values).float()
    noisy = value_fit_metrics(values, adv + values + torch.tensor([[0.0, 3e-9, -2e-9]]), mask)
    assert "explained_variance" not in noisy
    # A real (small) spread is reported: constant values explain none of it, 1 - Var(r - 0.1) / Var(r) = 0.
    spread = value_fit_metrics(torch.full((1, 3), 0.1), torch.tensor([[0.0, 1e-3, 0.0]]), mask)
    assert spread["explained_variance"] == pytest.approx(0.0, abs=1e-6)
    bad = value_fit_metrics(torch.tensor([[0.0, float("inf"), 1.0]]), torch.tensor([[0.0, 1.0, 2.0]]), mask)
    assert math.isnan(bad["explained_variance"])  # a non-finite value: NaN (metrics.jsonl null), never inf


def test_one_critic_logs_the_fit_of_the_values_gae_used() -> None:
    values = torch.tensor([[1.0, 2.0], [2.0, 5.0]])
    critics = Critics([_Critic(values, engine_metrics(2.0, 1.0, 1e-5, 2.0, 3.0))], AlgoConfig(adv_estimator="gae"))
    batch = Batch({"row": torch.arange(2), "response_mask": torch.ones(2, 2)})
    out = step(critics, batch, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert out["critic/explained_variance"] == pytest.approx(0.6)
    assert (out["critic/values_mean"], out["critic/returns_mean"]) == (2.5, 2.5)
    assert (out["critic/grad_norm"], out["critic/lr"], out["critic/optimizer_steps"]) == (1.0, 1e-5, 2.0)


def two_critic_step(metrics: list[dict[str, float]]) -> StepLog:
    """Two critics whose values are 1, 2 / 3, 4 on every token of rows 0, 1 / 2, 3 (mean: the rows' index + 1
    shifted), each with its own train metrics."""
    base = torch.arange(4.0).unsqueeze(-1).repeat(1, 2)
    groups = [_Critic(base, metrics[0]), _Critic(base + 2.0, metrics[1])]
    critics = Critics(groups, AlgoConfig(adv_estimator="gae", group_size=2, num_critics=2))
    batch = Batch({"row": torch.arange(4), "response_mask": torch.ones(4, 2)})
    return step(critics, batch, base + 1.0)


def test_two_critics_get_every_metric_aggregated_under_critic() -> None:
    """grad_norm weighted by the optimizer steps (3 x 1 + 1 x 5) / 4 = 2; lr the common value; counts and times
    summed; the losses' plain mean; maxima the largest. The fit uses the ensemble's mean values (base + 1, the
    returns: a perfect fit)."""
    out = two_critic_step([engine_metrics(2.0, 1.0, 1e-5, 3.0, 1.5), engine_metrics(4.0, 5.0, 1e-5, 1.0, 2.0)])
    assert out["critic/grad_norm"] == 2.0 and out["critic/lr"] == 1e-5
    assert (out["critic/optimizer_steps"], out["critic/train_seconds"], out["critic/rows"]) == (4.0, 3.5, 4.0)
    assert (out["critic/vf_loss"], out["critic/vf_clipfrac"], out["critic/scaler_skip_streak_max"]) == (3.0, 0.5, 3.0)
    assert (out["critic_0/grad_norm"], out["critic_1/grad_norm"], out["critic_1/optimizer_steps"]) == (1.0, 5.0, 1.0)
    assert out["critic/explained_variance"] == 1.0 and out["critic/values_mean"] == 2.5


def test_one_and_two_critics_log_the_same_critic_keys() -> None:
    """A PPO dashboard's critic/ panels exist in an AsyPPO run (which adds only its ensemble's own keys)."""
    m = engine_metrics(2.0, 1.0, 1e-5, 2.0, 3.0)
    one = Critics([_Critic(torch.zeros(4, 2), m)], AlgoConfig(adv_estimator="gae", group_size=2))
    batch = Batch({"row": torch.arange(4), "response_mask": torch.ones(4, 2)})
    single = {k for k in step(one, batch, torch.arange(8.0).view(4, 2)) if k.startswith("critic/")}
    several = {k for k in two_critic_step([m, m]) if k.startswith("critic/")}
    ensemble_only = {"critic/rows", "critic/ensemble_std_mean"} | {
        f"critic/{k}_masked_fraction" for k in ("advantage", "entropy")
    }
    assert single == several - ensemble_only
    assert {"critic/grad_norm", "critic/lr", "critic/optimizer_steps", "critic/explained_variance"} <= single


def test_merge_lr_means_and_no_step_taken() -> None:
    """Different rates: the mean over the optimizer steps taken; no critic took a step: no norm, the mean rate."""
    got = merge_critic_metrics([{"lr": 1.0, "optimizer_steps": 1.0}, {"lr": 4.0, "optimizer_steps": 2.0}])
    assert got == {"lr": 3.0, "optimizer_steps": 3.0}
    idle = merge_critic_metrics([{"lr": 1.0, "optimizer_steps": 0.0}, {"lr": 3.0, "optimizer_steps": 0.0}])
    assert idle == {"lr": 2.0, "optimizer_steps": 0.0}
