"""A mini-batch without a trainable token (every response empty or fully masked) takes no optimizer step, under
every loss aggregation: the weights, Adam's moments and the LR schedule stay as they were, and the step counts it
in `empty_mini_batches`. Under seq-mean-token-sum(-norm) the loss units are rows, empty ones included, so such a
mini-batch had units and a zero loss and still stepped: AdamW's weight decay and the momentum of earlier steps moved
every weight, and the schedule advanced."""

from __future__ import annotations

import pytest
import torch

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_engines.train.hf import HFTrainEngine

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
#: weight decay > 0: a step on a zero gradient still moves every decayed weight.
SETTINGS = {"lr": 1e-2, "weight_decay": 0.5, "micro_batch_size": 2}


def _masked(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    """`batch` with the responses of `rows` fully masked (nothing to train on there)."""
    out = dict(batch)
    out["response_mask"] = batch["response_mask"].clone()
    out["response_mask"][rows] = 0
    return out


def _weights(engine: HFTrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.get_weights().items()}


@pytest.mark.parametrize("agg", AGGS)
def test_a_mini_batch_without_trainable_tokens_takes_no_step(tiny: str, agg: str) -> None:
    engine = HFTrainEngine(tiny, **SETTINGS)
    objective = PolicyObjective(agg=agg, norm_length=8)
    batch = toy_batch(tiny)
    engine.train_step(batch, objective)  # Adam's moments are not 0 now: any later step moves the weights
    before, schedule = _weights(engine), engine.scheduler.last_epoch
    out = engine.train_step(_masked(batch, list(range(6))), objective, mini_batches=2)
    after = _weights(engine)
    for name, w in before.items():
        assert torch.equal(after[name], w), name
    assert engine.scheduler.last_epoch == schedule
    assert out["optimizer_steps"] == 0 and out["nonfinite_steps"] == 0 and "grad_norm" not in out
    assert out["empty_mini_batches"] == 2


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "token-mean"])
def test_an_empty_mini_batch_beside_a_real_one_leaves_the_real_ones_step(tiny: str, agg: str) -> None:
    """Two mini-batches, the second without a trainable token: one step, the same as training the first alone."""
    objective = PolicyObjective(agg=agg)
    batch = toy_batch(tiny)
    both = HFTrainEngine(tiny, **SETTINGS)
    out = both.train_step(_masked(batch, [3, 4, 5]), objective, mini_batches=2)
    alone = HFTrainEngine(tiny, **SETTINGS)
    alone.train_step({k: v[:3] for k, v in batch.items()}, objective)
    want = _weights(alone)
    for name, w in _weights(both).items():
        torch.testing.assert_close(w, want[name], atol=0, rtol=0, msg=name)
    assert both.scheduler.last_epoch == alone.scheduler.last_epoch == 1
    assert out["optimizer_steps"] == 1 and out["empty_mini_batches"] == 1


class _NanWhenEmptyThenOverflowing(PolicyObjective):
    """NaN on a micro-batch without tokens (a custom loss's 0/0); otherwise the policy loss times 1e30, which
    overflows fp16's gradients at any loss scale (finite in fp32)."""

    def __call__(self, outputs: dict, micro: dict) -> tuple:
        loss, m = super().__call__(outputs, micro)
        return (loss * float("nan") if micro["response_mask"].sum() == 0 else loss * 1e30), m


def test_an_empty_mini_batch_leaves_the_next_ones_overflow_an_overflow(tiny: str) -> None:
    """fp16: the empty mini-batch's NaN loss must not be carried into the next mini-batch, whose scaler overflow
    (finite losses) was then counted as a non-finite step (what stops a run: pipeline.max_nonfinite_steps)."""
    engine = HFTrainEngine(tiny, lr=1e-4, dtype="float16", param_dtype="float32", micro_batch_size=6)
    out = engine.train_step(_masked(toy_batch(tiny), [0, 1, 2]), _NanWhenEmptyThenOverflowing(), mini_batches=2)
    assert out["scaler_skipped_steps"] == 1 and out["nonfinite_steps"] == 0
    assert out["empty_mini_batches"] == 1 and out["optimizer_steps"] == 0


def test_megatron_takes_no_step_on_a_mini_batch_without_trainable_tokens(tiny: str, megatron_process_group) -> None:
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    from roll_engines.train.megatron import MegatronTrainEngine

    engine = MegatronTrainEngine(tiny, dist_backend="gloo", use_distributed_optimizer=False, **SETTINGS)
    objective, batch = PolicyObjective(agg="seq-mean-token-sum"), toy_batch(tiny)
    engine.train_step(batch, objective)
    before, schedule = _weights(engine), engine._step
    out = engine.train_step(_masked(batch, list(range(6))), objective, mini_batches=2)
    after = _weights(engine)
    for name, w in before.items():
        assert torch.equal(after[name], w), name
    assert engine._step == schedule and out["optimizer_steps"] == 0 and out["nonfinite_steps"] == 0
    assert out["empty_mini_batches"] == 2


def _rank(rank: int, port: int, path: str, out: str) -> None:
    """One of two fsdp2 gloo ranks: a step where only rank 1 holds trainable tokens (both ranks step), then one
    where neither does (neither steps)."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import torch.distributed as dist

    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    engine = FSDP2TrainEngine(path, dist_backend="gloo", num_threads=1, **SETTINGS)
    objective = PolicyObjective(agg="seq-mean-token-sum")
    mine = {k: v[[0, 1, 2] if rank == 0 else [3, 4, 5]] for k, v in toy_batch(path).items()}
    one = engine.train_step(_masked(mine, [0, 1, 2]) if rank == 0 else mine, objective)
    weights = engine.get_weights()
    none = engine.train_step(_masked(mine, [0, 1, 2]), objective)
    after = engine.get_weights()  # (collective)
    if rank == 0:
        torch.save({"one": one, "none": none, "weights": weights, "after": after}, out)
    dist.barrier()
    dist.destroy_process_group()


def test_two_fsdp2_ranks_agree_on_an_empty_mini_batch(tiny: str, tmp_path) -> None:
    import multiprocessing
    import time

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port

    out = tmp_path / "rank0.pt"
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "transformers"])
    ranks = mp.start_processes(
        _rank, args=(free_port(), tiny, str(out)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=2):  # raises what a rank raised
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the two fsdp2 ranks did not finish in 180 s")
    got = torch.load(out, weights_only=False)
    # Rank 0 had no trainable token but rank 1 had: both stepped, as one process on the whole batch does.
    assert got["one"]["optimizer_steps"] == 1
    single = HFTrainEngine(tiny, **SETTINGS)
    want = single.train_step(_masked(toy_batch(tiny), [0, 1, 2]), PolicyObjective(agg="seq-mean-token-sum"))
    assert got["one"]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)  # (Adam's first step ignores scale)
    for name, w in single.get_weights().items():
        # atol 1e-4: the step moves weights by ~lr (1e-2); a near-zero gradient's rounding noise moves a few of
        # them by less (as in test_fsdp2_ranks.py).
        torch.testing.assert_close(got["weights"][name], w, atol=1e-4, rtol=0, msg=name)
    # No rank had one: no step, the weights unchanged.
    for name, w in got["weights"].items():
        assert torch.equal(got["after"][name], w), name
    assert got["none"]["optimizer_steps"] == 0 and got["none"]["empty_mini_batches"] == 1
    assert got["one"]["empty_mini_batches"] == 0
