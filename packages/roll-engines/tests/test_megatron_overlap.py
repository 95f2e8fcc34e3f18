"""Megatron's communication overlap (`train_engine.overlap_grad_reduce`, `overlap_param_gather`) on two gloo ranks
(data-parallel size 2): the same trained weights and gradients as without overlap, and the combinations Megatron
does not run refused at config time. Without overlap the two ranks (distributed optimizer: Adam's state sharded over
them) equal the single-process hf engine on the whole batch: this is CI's DP=2 distributed-optimizer parity test
(tests/e2e/test_megatron_ray.py runs it on Ray under `nox -s full_matrix`).

The gradients are reduced in several buckets (the tiny model is smaller than Megatron's 40M-element default
bucket, so the ranks shrink it to 20k elements): each bucket's reduce-scatter starts from the backward hooks of the
last micro-batch, and after each distributed-optimizer step each bucket's all-gather waits for the next forward
(or for the export of the weights). Two steps, because Megatron dispatches from the hooks from the second batch on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

SETTINGS = {  # name: (use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather)
    "plain": (True, False, False),
    "both": (True, True, True),
    "ddp-grad": (False, True, False),  # all-reduce instead of reduce-scatter, Megatron's plain optimizer
}


def _objective():
    from roll_core.pipelines.objectives import PolicyObjective

    return PolicyObjective(agg="token-mean", entropy_coef=0.5)  # the entropy bonus trains too


def _rank(rank: int, port: int, path: str, out: str) -> None:
    """One of two data-parallel gloo ranks: per setting, two train steps on this rank's rows, then the weights and
    the gradients of one more backward (compute_gradients: all-reduced whole even under the distributed optimizer)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import dataclasses

    import megatron.core.distributed as md
    import torch.distributed as dist

    from roll_core.testing.batches import toy_batch
    from roll_engines.train.megatron import MegatronTrainEngine

    @dataclasses.dataclass
    class SmallBuckets(md.DistributedDataParallelConfig):
        bucket_size: int | None = 20_000  # several buckets of the tiny model (used with overlap_grad_reduce only)

    md.DistributedDataParallelConfig = SmallBuckets  # the engine imports it from the module at build time
    batch = toy_batch(path)
    mine = {k: v[rank::2] for k, v in batch.items()}  # different rows per rank: the reduction matters
    results = {}
    for name, (distributed, grad, param) in SETTINGS.items():
        eng = MegatronTrainEngine(
            path,
            lr=1e-2,
            micro_batch_size=1,  # three micro-batches per step: only the last one's backward reduces
            dist_backend="gloo",
            num_threads=1,
            use_distributed_optimizer=distributed,
            overlap_grad_reduce=grad,
            overlap_param_gather=param,
        )
        buckets = len(eng.ddp.bucket_groups)
        for _ in range(2):
            eng.train_step(mine, _objective())
        weights = eng.get_weights()
        grads = eng.compute_gradients(mine, _objective())
        results[name] = {"weights": weights, "grads": grads, "buckets": buckets}
        if name == "plain":  # 3 rows a rank, 6 mini-batches: one process's 6 optimizer steps of one row each (each
            # rank cutting its own 3 rows took 3, the other three mini-batches empty on both ranks)
            results["mini_batch_steps"] = eng.train_step(mine, _objective(), mini_batches=6)["optimizer_steps"]
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def test_overlap_trains_the_same_weights_on_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    import multiprocessing

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port
    from roll_core.models import resolve_model_path

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    path = resolve_model_path("builtin:tiny")
    out = tmp_path / "overlap.pt"
    # A fork server that imported torch and Megatron once. The same preload list as test_topk_logprobs.py's TP=2
    # test: one pytest process has one fork server, so whichever test starts it, the other's ranks fork at no
    # import cost (the ranks' own work is ~1 s each; the imports are most of this test's time when it starts it).
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "transformers", "megatron.core", "roll_engines.train.megatron", "roll_core.testing.train_engine"]
    )
    ranks = mp.start_processes(
        _rank, args=(free_port(), path, str(out)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=1):  # raises what a rank raised
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the two Megatron ranks did not finish in 180 s")
    got = torch.load(out, weights_only=False)
    plain = got["plain"]
    assert got.pop("mini_batch_steps") == 6.0
    assert plain["buckets"] == 1 and got["both"]["buckets"] >= 3, {k: v["buckets"] for k, v in got.items()}
    # The same two steps by the single-process hf engine on the whole batch (both ranks' rows).
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.hf import HFTrainEngine

    batch = toy_batch(path)
    hf = HFTrainEngine(path, lr=1e-2, micro_batch_size=2)
    start = hf.get_weights()
    for _ in range(2):
        hf.train_step(batch, _objective())
    moved = max((plain["weights"][k] - v).abs().max().item() for k, v in start.items())
    assert moved > 1e-3, "the two steps did not move the weights"
    # Adam's first steps are lr * g / (|g| + eps): near-zero gradients amplify float noise, so compare at 2% of lr.
    for k, w in hf.get_weights().items():
        torch.testing.assert_close(plain["weights"][k], w, atol=2e-4, rtol=0, msg=f"hf: {k}")
    for k, g in hf.compute_gradients(batch, _objective()).items():
        torch.testing.assert_close(plain["grads"][k], g, atol=1e-5, rtol=1e-3, msg=f"hf gradient: {k}")
    for name in ("both", "ddp-grad"):
        for key in ("weights", "grads"):
            want, have = plain[key], got[name][key]
            assert set(have) == set(want), (name, key)
            for k, v in want.items():
                torch.testing.assert_close(have[k], v, atol=1e-6, rtol=1e-5, msg=f"{name} {key} {k}")


def test_overlap_combinations_megatron_does_not_run_are_refused() -> None:
    from roll_core.config import load_config

    base = ["train_engine=megatron"]
    with pytest.raises(ValueError, match=r"overlap_param_gather=true needs train_engine\.use_distributed_optimizer"):
        load_config(
            [
                *base,
                "train_engine.overlap_param_gather=true",
                "train_engine.overlap_grad_reduce=true",
                "train_engine.use_distributed_optimizer=false",
            ]
        )
    with pytest.raises(ValueError, match=r"overlap_param_gather=true needs train_engine\.overlap_grad_reduce"):
        load_config([*base, "train_engine.overlap_param_gather=true"])
    cfg = load_config([*base, "train_engine.overlap_grad_reduce=true", "train_engine.overlap_param_gather=true"])
    assert cfg.train_engine.overlap_grad_reduce and cfg.train_engine.overlap_param_gather


def test_the_schedules_grad_sync_keeps_force_all_reduce() -> None:
    """Later pipeline stages start their reductions through `config.grad_sync_func`, not the backward hooks: it must
    pass the DDP's `force_all_reduce` (compute_gradients: whole gradients) as the hooks do; megatron-core's own
    `start_grad_sync` starts a reduce-scatter whatever the flag (4 gloo ranks, PP 2 x DP 2, would show it end to
    end; this checks the wiring)."""
    from types import SimpleNamespace

    pytest.importorskip("megatron.core")
    import megatron.core.distributed as md

    from roll_engines.train.megatron._optimizer import grad_sync_func

    calls: list[tuple[str, bool]] = []

    class Group:
        def __init__(self, name: str) -> None:
            self.name = name

        def start_grad_sync(self, force_all_reduce: bool = False) -> None:
            calls.append((self.name, force_all_reduce))

    ddp = SimpleNamespace(bucket_groups=[Group("a"), Group("b")], expert_parallel_bucket_groups=[Group("e")])
    for force in (True, False):
        ddp.force_all_reduce, calls[:] = force, []
        grad_sync_func(ddp)(["parameters", "ignored"])
        assert calls == [("a", force), ("b", force), ("e", force)]
    ddp.force_all_reduce, calls[:] = True, []
    md.DistributedDataParallel.start_grad_sync(ddp)  # what the engine passed before: the flag is dropped
    assert calls == [("a", False), ("b", False), ("e", False)]
