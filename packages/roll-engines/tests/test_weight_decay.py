"""Weight decay skips biases and norm weights on every train engine (hf, fsdp2, megatron), as HF Trainer, Megatron
and torchtune do; `decay_norms_and_biases=True` decays them too. Checked on the update itself: with zero advantages
every gradient is exactly 0, so AdamW's step is the decay alone (w -> w (1 - lr wd)) and a skipped parameter does
not move."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_engines.train._optim import no_decay, param_groups

LR, WD = 1e-2, 0.5


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2: q/k/v biases, RMSNorm weights, untied embeddings and head."""
    from roll_core.testing.models import tiny_model

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return tiny_model("qwen2", tmp_path_factory.mktemp("qwen2") / "m")


def _decay_only_step(engine: Any, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    batch = toy_batch(path)
    batch["advantages"] = torch.zeros_like(batch["advantages"])  # zero gradients: the step is the decay alone
    before = {k: v.detach().float().clone() for k, v in engine.get_weights().items()}
    out = engine.train_step(batch, PolicyObjective())
    assert out["optimizer_steps"] == 1
    return before, {k: v.detach().float().clone() for k, v in engine.get_weights().items()}


def _assert_decayed(before: dict, after: dict, decay_all: bool) -> None:
    skipped = [k for k in before if before[k].ndim < 2 or k.endswith(".bias")]
    assert any(k.endswith(".bias") for k in skipped) and any("norm" in k for k in skipped)
    for name, w in before.items():
        decays = decay_all or name not in skipped
        want = w * (1 - LR * WD) if decays else w
        torch.testing.assert_close(after[name], want, atol=1e-6, rtol=1e-6, msg=name)


def test_the_groups_put_biases_and_norms_at_zero_decay() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[1].weight.requires_grad_(False)  # frozen: in no group
    decay, skip = param_groups(model, 0.1)
    assert decay == {"params": [model[0].weight], "weight_decay": 0.1}
    assert skip["weight_decay"] == 0.0 and skip["params"] == [model[1].bias, model[2].weight, model[2].bias]
    assert [g["weight_decay"] for g in param_groups(model, 0.1, decay_norms_and_biases=True)] == [0.1, 0.1]
    assert no_decay("x.bias", torch.zeros(2, 2)) and not no_decay("x.weight", torch.zeros(2, 2))
    # Nothing to skip: the empty group is left out.
    assert len(param_groups(torch.nn.Linear(2, 2, bias=False), 0.1)) == 1


@pytest.mark.parametrize("decay_all", [False, True])
@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_hf_and_fsdp2_decay_neither_biases_nor_norms(qwen2: str, kind: str, decay_all: bool) -> None:
    import torch.distributed as dist

    from roll_engines.train.fsdp2 import FSDP2TrainEngine
    from roll_engines.train.hf import HFTrainEngine

    kw = dict(lr=LR, weight_decay=WD, micro_batch_size=6, decay_norms_and_biases=decay_all)
    try:
        engine = FSDP2TrainEngine.conformance_engine(qwen2, **kw) if kind == "fsdp2" else HFTrainEngine(qwen2, **kw)
        _assert_decayed(*_decay_only_step(engine, qwen2), decay_all)
    finally:
        if kind == "fsdp2" and dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("distributed", [False, True])
def test_megatron_decays_neither_biases_nor_norms(qwen2: str, distributed: bool, tmp_path: Path) -> None:
    """megatron-core puts biases and 1-D parameters in wd_mult=0 groups, but only its own LR scheduler applies the
    multiplier; this engine schedules the LR itself, and every parameter decayed at the full rate. A resumed run
    keeps the groups' rates (this run's weight decay, none on the wd_mult=0 groups)."""
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from roll_engines.train.megatron import MegatronTrainEngine

    try:
        kw = dict(lr=LR, weight_decay=WD, micro_batch_size=6, use_distributed_optimizer=distributed)
        engine = MegatronTrainEngine(qwen2, dist_backend="gloo", **kw)
        _assert_decayed(*_decay_only_step(engine, qwen2), decay_all=False)
        engine.save(tmp_path / "ckpt")
        resumed = MegatronTrainEngine(qwen2, dist_backend="gloo", **{**kw, "weight_decay": 0.25})
        resumed.load(tmp_path / "ckpt")
        rates = {(g["wd_mult"], g["weight_decay"]) for g in resumed.optimizer.param_groups if g["params"]}
        assert rates == {(1.0, 0.25), (0.0, 0.0)}
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_megatron_decay_override_reaches_every_group() -> None:
    from types import SimpleNamespace

    from roll_engines.train.megatron._optimizer import apply_weight_decay

    opt = SimpleNamespace(param_groups=[{"wd_mult": 1.0}, {"wd_mult": 0.0}, {}])
    apply_weight_decay(opt, 0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.1]
    apply_weight_decay(opt, 0.1, decay_norms_and_biases=True)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1, 0.1]


def test_a_resumed_run_keeps_the_groups_rates(qwen2: str, tmp_path: Path) -> None:
    """The checkpoint's optimizer holds both groups; a resume restores each group's configured decay (the skipped
    group stays at 0, not the checkpoint's or the decayed group's rate)."""
    from roll_engines.train.hf import HFTrainEngine

    saved = HFTrainEngine(qwen2, lr=LR, weight_decay=WD, micro_batch_size=6)
    saved.train_step(toy_batch(qwen2), PolicyObjective())
    saved.save(tmp_path / "ckpt")
    resumed = HFTrainEngine(qwen2, lr=LR, weight_decay=0.25, micro_batch_size=6)
    resumed.load(tmp_path / "ckpt")
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.25, 0.0]
    assert all(len(s) for s in resumed.optimizer.state.values())


def test_a_checkpoint_with_one_param_group_resumes(qwen2: str, tmp_path: Path) -> None:
    """Checkpoints written before the no-decay group held one group for every parameter: they load, each parameter's
    moments by name into whichever group holds it now (DCP failed on the missing second group)."""
    from roll_engines.train.hf import HFTrainEngine

    old = HFTrainEngine(qwen2, lr=LR, weight_decay=WD, micro_batch_size=6)
    trained = [p for p in old.model.parameters() if p.requires_grad]
    old.optimizer = torch.optim.AdamW(trained, lr=LR, weight_decay=WD)  # the old engine's single group
    old.scheduler = torch.optim.lr_scheduler.LambdaLR(old.optimizer, lambda step: 1.0)
    old.train_step(toy_batch(qwen2), PolicyObjective())
    old.save(tmp_path / "ckpt")
    resumed = HFTrainEngine(qwen2, lr=LR, weight_decay=WD, micro_batch_size=6)
    resumed.load(tmp_path / "ckpt")
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [WD, 0.0]
    saved = {n: old.optimizer.state[p] for n, p in old.model.named_parameters()}
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(resumed.optimizer.state[p]["exp_avg"], saved[name]["exp_avg"], msg=name)
        assert float(resumed.optimizer.state[p]["step"]) == 1.0
