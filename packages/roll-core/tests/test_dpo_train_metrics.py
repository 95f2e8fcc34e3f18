"""DPO's actor/ train metrics over its one-optimizer-step passes (roll_core.pipelines.objectives.dpo), on the tiny
model through the hf engine: `actor/grad_norm` and `actor/lr` are means over the optimizer steps taken, so a pass
skipped for a non-finite gradient weighs nothing (the norm was divided by every pass and read half of the true one
with one of two passes skipped; `lr` was the schedule's value after the last pass, not a rate any step applied)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from roll_core.cluster.roles import TrainWorker
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.dpo import DPOObjective, dpo_objective
from roll_core.seeds import Purpose, derive_seed

PAIRS, LR, WARMUP = 4, 1e-2, 4


def _setup(tmp_path: Path) -> tuple[DPOObjective, object, object]:
    """A DPO objective on the tiny model (2 mini-batches of 2 pairs a step, warm-up of 4 steps), its roles and a
    batch of PAIRS pairs with row ids."""
    from transformers import AutoTokenizer

    from roll_core.cluster.launch import Cluster
    from roll_core.config import load_config
    from roll_core.models import resolve_model_path
    from roll_core.pipelines.wiring import build_roles
    from roll_core.posttrain.source import load_rows
    from roll_core.testing import constant_answer_task, tiny_overrides

    rng = random.Random(0)
    rows = [
        {"prompt": f"Q{i}: answer", "chosen": f"{rng.randrange(1000):03d}", "rejected": "abc"[: 2 + i % 2]}
        for i in range(PAIRS)
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = constant_answer_task(tmp_path / "seven.jsonl", rows=8)
    base = [o for o in tiny_overrides(task, tmp_path / "run") if not o.startswith("algo.")]
    cfg = load_config(
        [
            *base,
            "pipeline=dpo",
            f"data.path={tmp_path / 'pairs.jsonl'}",
            f"pipeline.rollout_batch_size={PAIRS}",
            "algo.num_mini_batches=2",
            f"algo.lr={LR}",
            f"algo.warmup_steps={WARMUP}",
            "algo.lr_schedule=constant",
            "algo.max_grad_norm=0",  # the reported norm is the gradient's own, whatever it is
        ]
    )
    path = resolve_model_path(cfg.model.path)
    roles = build_roles(cfg, Cluster(cfg.cluster, cfg.hw), path, dpo_objective.needs(cfg))
    tok = AutoTokenizer.from_pretrained(path)
    batch = load_rows("preference", cfg.data, tok, max_prompt_length=64, max_response_length=6).train.batch(
        list(range(PAIRS))
    )
    batch["row_id"] = torch.arange(2 * PAIRS)
    return DPOObjective(cfg, roles), roles, batch


def _grad_norm(obj: DPOObjective, roles: object, batch: object, pairs: torch.Tensor) -> float:
    """The total gradient norm of one mini-batch's surrogate at the current weights (no step)."""
    rows = torch.stack([2 * pairs, 2 * pairs + 1], dim=1).flatten()
    ref, _ = obj.reference_logps(batch)
    mini, loss_fn, _ = obj.surrogate(batch.index(rows), ref[rows])
    grads = roles.actor_train.call(TrainWorker.compute_gradients, mini, loss_fn)[0]
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def test_grad_norm_and_lr_are_means_over_the_steps_taken(tmp_path: Path) -> None:
    obj, roles, batch = _setup(tmp_path)
    step = 1
    gen = torch.Generator().manual_seed(derive_seed(obj.cfg.pipeline.seed, Purpose.SHUFFLE, step))
    parts = torch.tensor_split(torch.randperm(PAIRS, generator=gen), 2)  # the objective's mini-batches of pairs
    clean = next(p for p in parts if 0 not in p.tolist())
    want = _grad_norm(obj, roles, batch, clean)  # the skipped pass changes nothing: the clean one sees these weights
    assert want > 0
    # Pair 0's reference log-prob is NaN: its mini-batch's gradient is non-finite and that optimizer step is skipped.
    obj.ref_cache[0] = math.nan
    out = StepLog()
    obj.update(step, Collected(batch, batch["is_chosen"].float()), out)
    assert out["actor/optimizer_steps"] == 1.0 and out["actor/nonfinite_steps"] == 1.0
    assert out["actor/grad_norm"] == pytest.approx(want, rel=1e-4)  # the stepped pass's, not half of it
    assert out["actor/lr"] == pytest.approx(LR * 1 / WARMUP)  # the engine's first step applied the warm-up's 1/4

    # A clean step: two optimizer steps, at 2/4 and 3/4 of the rate; their norms averaged.
    obj.ref_cache.clear()
    out = StepLog()
    obj.update(step + 1, Collected(batch, batch["is_chosen"].float()), out)
    assert out["actor/optimizer_steps"] == 2.0 and out["actor/nonfinite_steps"] == 0.0
    assert out["actor/lr"] == pytest.approx(LR * (2 / WARMUP + 3 / WARMUP) / 2)
    assert out["actor/grad_norm"] > 0 and math.isfinite(out["actor/grad_norm"])
