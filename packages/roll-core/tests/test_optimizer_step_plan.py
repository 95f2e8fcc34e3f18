"""The LR schedule's plan of optimizer steps per training step (roll_core.pipelines.wiring.optimizer_schedule:
algo.ppo_epochs x mini-batches, also the runtime's `optimizer_steps_per_step` a resume re-bases on) equals the steps
every objective's update takes: SFT and offline distillation train each batch once (they refuse ppo_epochs > 1),
DPO takes ppo_epochs passes of whole-pair mini-batches, RL ppo_epochs x mini-batches for the actor and each
critic. AsyPPO's mini-critics train on 1 / num_critics of the rows in the actor's mini-batches: a shard with fewer
rows than mini-batches left some empty (no step), so their schedule never reached its end; that is a ConfigError.

A train call's steps are counted as the engines take them: `epochs` x the non-empty parts of
roll_engines.train._micro.mini_batch_rows (an empty mini-batch takes no step)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.config import load_config
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives import load_objective
from roll_core.pipelines.wiring import mini_batches, optimizer_schedule
from roll_core.posttrain.distill import TEACHER_IDS, TEACHER_LOGPROBS
from roll_core.protocol import Batch
from roll_engines.train._micro import mini_batch_rows

P, R, K = 3, 4, 2  # prompt and response widths, teacher top-k


def _engine_steps(rows: int, n_mini: int, epochs: int) -> int:
    """Optimizer steps one engine takes for a train call over `rows` rows (one rank)."""
    parts = mini_batch_rows(torch.arange(rows), [rows], 0, n_mini)
    return epochs * sum(1 for p in parts if len(p))


class _Group:
    """A train group counting the optimizer steps of its train calls; log-probs and values of zeros."""

    def __init__(self) -> None:
        self.steps = 0

    def train(self, batch: Batch, loss: Any, *, mini_batches: int = 1, epochs: int = 1, **_: Any) -> dict[str, float]:
        self.steps += _engine_steps(len(batch), mini_batches, epochs)
        return {}

    def compute_logprobs(self, batch: Batch, temperature: float, **_: Any) -> dict[str, torch.Tensor]:
        return {"logprobs": torch.full(batch["responses"].shape, -1.0)}

    def compute_values(self, batch: Batch, **_: Any) -> dict[str, torch.Tensor]:
        return {"values": torch.zeros(batch["responses"].shape)}


def _roles(cfg: Any, critics: int = 0) -> SimpleNamespace:
    groups = [_Group() for _ in range(critics)]
    return SimpleNamespace(
        actor_train=_Group(),
        reference=None,
        reference_is_base=False,
        critic=groups[0] if groups else None,
        critics=groups,
        sampling=SimpleNamespace(temperature=1.0),
        mini_batches=mini_batches(cfg),
        teachers={},
    )


def _batch(rows: int, chosen: bool = False) -> Batch:
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(3, 20, (rows, R), generator=g)
    tensors = {
        "input_ids": torch.cat([torch.randint(3, 20, (rows, P), generator=g), responses], 1),
        "attention_mask": torch.ones(rows, P + R, dtype=torch.long),
        "position_ids": torch.arange(P + R).expand(rows, -1).clone(),
        "responses": responses,
        "response_mask": torch.ones(rows, R, dtype=torch.long),
        "behaviour_logprobs": torch.full((rows, R), -1.0),
        TEACHER_IDS: torch.randint(3, 20, (rows, R, K), generator=g),
        TEACHER_LOGPROBS: torch.log(torch.tensor([0.6, 0.3])).expand(rows, R, K).clone(),
    }
    if chosen:
        tensors |= {"is_chosen": torch.arange(rows) % 2 == 0, "row_id": torch.arange(rows)}
    return Batch(tensors)


def _plan(cfg: Any) -> int:
    plan = optimizer_schedule(cfg)
    assert plan["total_steps"] == cfg.pipeline.max_steps * plan["optimizer_steps_per_step"]
    return plan["optimizer_steps_per_step"]


@pytest.mark.parametrize(
    ("objective", "overrides"),
    [
        ("sft", ["pipeline=sft", "algo.num_mini_batches=3"]),
        ("sft", ["pipeline=sft", "algo.mini_batch_size=4"]),
        ("distill_offline", ["pipeline=distill_offline", "algo.num_mini_batches=3"]),
        ("dpo", ["pipeline=dpo", "algo=dpo", "dpo.loss=simpo", "algo.num_mini_batches=3", "algo.ppo_epochs=2"]),
        ("dpo", ["pipeline=dpo", "algo=dpo", "dpo.loss=simpo", "algo.mini_batch_size=4", "algo.ppo_epochs=3"]),
        ("rl", ["algo=grpo", "algo.num_mini_batches=4", "algo.ppo_epochs=2"]),
        ("rl", ["algo=ppo", "algo.num_mini_batches=0", "algo.mini_batch_size=2", "algo.ppo_epochs=3"]),
        ("rl", ["algo=asyppo", "algo.num_mini_batches=4", "algo.ppo_epochs=2"]),
    ],
)
def test_each_objective_takes_the_optimizer_steps_the_schedule_plans(objective: str, overrides: list[str]) -> None:
    cfg = load_config(["model=tiny", "pipeline.max_steps=5", "pipeline.rollout_batch_size=8", *overrides])
    factory = load_objective(objective)
    needs = factory.needs(cfg)  # (the refusals run here, before build_roles plans the schedule)
    n_critics = cfg.algo.num_critics if needs.critic else 0
    roles = _roles(cfg, n_critics)
    obj = factory(cfg, roles, trajectories=False)
    rows = cfg.pipeline.rollout_batch_size * cfg.algo.group_size
    batch = _batch(rows, chosen=objective == "dpo")
    scores = torch.arange(rows, dtype=torch.float32) % 3
    obj.update(1, Collected(batch, scores), StepLog())
    plan = _plan(cfg)
    assert plan > 1
    assert roles.actor_train.steps == plan
    for critic in roles.critics:  # every critic engine runs the same schedule
        assert critic.steps == plan


@pytest.mark.parametrize("pipeline", ["sft", "distill_offline"])
def test_a_single_pass_objective_refuses_ppo_epochs(pipeline: str) -> None:
    cfg = load_config(["model=tiny", f"pipeline={pipeline}", "algo.ppo_epochs=2"])
    with pytest.raises(ConfigError, match=r"algo\.ppo_epochs=2: .* trains each batch of rows once"):
        load_objective(pipeline).needs(cfg)


@pytest.mark.parametrize(
    ("setting", "allowed"),
    [
        # 2 prompts x 4 responses = 8 rows, 4 per critic
        ("algo.num_mini_batches=5", "algo.num_mini_batches=4"),
        ("algo.mini_batch_size=1", "algo.mini_batch_size=2"),
    ],
)
def test_mini_critics_with_fewer_rows_than_mini_batches_are_refused(setting: str, allowed: str) -> None:
    base = ["model=tiny", "algo=asyppo", "algo.num_mini_batches=0", "pipeline.rollout_batch_size=2"]
    base.append("algo.group_size=4")
    refused = load_config([*base, setting])
    # the critics' shard of 4 rows in 5 (8) mini-batches: 1 (4) of them empty per epoch, the plan says 5 (8)
    n_mini = mini_batches(refused)
    assert _engine_steps(4, n_mini, 1) < _plan(refused)
    with pytest.raises(ConfigError, match=r"algo\.num_critics=2: each critic trains on 4 of the 8 rows"):
        load_objective("rl").needs(refused)
    ok = load_config([*base, allowed])
    load_objective("rl").needs(ok)
    assert _engine_steps(4, mini_batches(ok), 1) == _plan(ok)
