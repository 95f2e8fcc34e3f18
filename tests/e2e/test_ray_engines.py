"""Engines on Ray: FSDP2 over 2 worker processes matches the single-process engine; placement facts."""

from __future__ import annotations

import pytest
import torch

from roll_core.cluster.group import RayOptions
from roll_core.cluster.roles import TrainGroup, TrainWorker
from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.protocol import Batch, build_sequences, pad_left

pytestmark = pytest.mark.ray


def _batch(path: str) -> Batch:
    from roll_engines.infer.hf import HFInferEngine

    infer = HFInferEngine(path, max_new_tokens=8)
    ids = [infer.tokenizer(p)["input_ids"] for p in ("abc", "What is 2+2?", "x y z")]
    gen = infer.generate(ids, infer.defaults.replace(seed=5), n=2)
    p_ids, p_mask = pad_left([x for x in ids for _ in range(2)], infer.pad_id)
    tensors = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    tensors.update(
        responses=gen.responses,
        response_mask=gen.response_mask,
        advantages=torch.linspace(-1, 1, 6)[:, None] * gen.response_mask,
    )
    return Batch(tensors)


def test_fsdp2_gradients_equal_single_process(ray_cluster) -> None:
    from roll_engines.config import FSDP2TrainEngineConfig
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny")
    batch = _batch(path)
    objective = PolicyObjective(agg="token-mean")
    single = HFTrainEngine(path, lr=1e-3, micro_batch_size=2)
    expected = single.compute_gradients(batch.tensors(), objective)

    engine = {k: v for k, v in vars(FSDP2TrainEngineConfig(micro_batch_size=2)).items()}
    group = TrainGroup(
        TrainWorker,
        2,
        "ray",
        ray_options=RayOptions(num_cpus=0.5),
        engine=engine,
        runtime={"model_path": path, "lr": 1e-3, "num_threads": 1, "dist_backend": "gloo"},
    )
    try:
        assert [r[:2] for r in group.call(TrainWorker.ping)] == [(0, 2), (1, 2)]
        pids = {r[2] for r in group.call(TrainWorker.ping)}
        assert len(pids) == 2  # two processes
        got = group.call(TrainWorker.compute_gradients, batch, objective)[0]  # uneven split: 3 + 3 rows
        assert set(got) == set(expected)
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-4, msg=name)
        # full weights gather on rank 0 and equal the single engine's initial weights
        weights = group.get_weights()
        for k, v in single.get_weights().items():
            torch.testing.assert_close(weights[k], v)
    finally:
        group.shutdown()


def _fsdp2_group(path: str, ranks: int, micro: int) -> TrainGroup:
    from roll_engines.config import FSDP2TrainEngineConfig

    return TrainGroup(
        TrainWorker,
        ranks,
        "ray",
        ray_options=RayOptions(num_cpus=0.5),
        engine=vars(FSDP2TrainEngineConfig(world_size=ranks, micro_batch_size=micro, logprob_chunk_size=micro)),
        runtime={"model_path": path, "lr": 1e-3, "num_threads": 1, "dist_backend": "gloo"},
    )


def _call(handle, timeout: float = 120.0):
    """Wait with a bound: mismatched collectives hang instead of failing."""
    import ray

    ready, _ = ray.wait(handle.refs, num_returns=len(handle.refs), timeout=timeout)
    assert len(ready) == len(handle.refs), "FSDP2 ranks hung (mismatched collectives)"
    return handle.values()


def test_fsdp2_uneven_rows_balance_collectives(ray_cluster) -> None:
    """5 rows over 2 ranks (3 + 2) in micro-batches of 2: the ranks need 2 and 1 micro-batches. Gradients equal
    the single-process engine's; log-probs come back for every row; 3 mini-batches over 2 rows still train."""
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny")
    full = _batch(path)
    batch = full.index(list(range(5)))
    objective = PolicyObjective(agg="token-mean")
    single = HFTrainEngine(path, lr=1e-3, micro_batch_size=2)
    expected = single.compute_gradients(batch.tensors(), objective)
    expected_logp = single.compute_logprobs(batch.tensors())["logprobs"]
    group = _fsdp2_group(path, 2, micro=2)
    try:
        got = _call(group.submit(TrainWorker.compute_gradients, batch, objective))[0]
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-4, msg=name)
        logp = Batch.concat(_call(group.submit(TrainWorker.compute_logprobs, batch)))["logprobs"]
        torch.testing.assert_close(logp, expected_logp, atol=1e-5, rtol=1e-5)
        # Rank 1: 2 rows, 3 mini-batches.
        metrics = _call(group.submit(TrainWorker.train, batch, objective, 3, 1, 1.0, 0))
        assert all(torch.isfinite(torch.tensor(m["grad_norm"])) for m in metrics)
        one_row = full.index([0])  # rank 1 gets no row at all
        assert _call(group.submit(TrainWorker.compute_gradients, one_row, objective))[0]
    finally:
        group.shutdown()


def test_sharded_trainer_refuses_the_local_backend() -> None:
    from roll_engines.config import FSDP2TrainEngineConfig

    with pytest.raises(ValueError, match=r"one process per rank .* use cluster=ray"):
        TrainGroup(TrainWorker, 2, "local", engine=vars(FSDP2TrainEngineConfig()), runtime={"model_path": "x"})


def test_fsdp2_checkpoint_resumes_at_another_world_size(ray_cluster, tmp_path) -> None:
    """Saved by FSDP2 on 2 ranks (optimizer state sharded through torch.distributed.checkpoint), resumed by the
    single-process engine: the next step equals the one the 2-rank run takes."""
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny")
    batch = _batch(path)
    objective = PolicyObjective(agg="token-mean")
    group = _fsdp2_group(path, 2, micro=3)
    try:
        _call(group.submit(TrainWorker.train, batch, objective, 1, 1, 1.0, 0))
        group.save(str(tmp_path / "ckpt"), path)
        _call(group.submit(TrainWorker.train, batch, objective, 1, 1, 1.0, 0))
        two_ranks = group.get_weights()
    finally:
        group.shutdown()
    assert sorted(p.name for p in (tmp_path / "ckpt" / "optimizer").iterdir() if p.suffix == ".distcp")[:2] == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # one shard file per rank
    single = HFTrainEngine(path, lr=1e-3, micro_batch_size=3)
    single.load(tmp_path / "ckpt")
    single.train_step(batch.tensors(), objective)
    for name, value in single.get_weights().items():
        torch.testing.assert_close(value, two_ranks[name], atol=1e-5, rtol=1e-4, msg=name)


def test_fsdp2_lora_matches_single_process_and_checkpoints(ray_cluster, tmp_path) -> None:
    pytest.importorskip("peft")
    from roll_engines.config import FSDP2TrainEngineConfig
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny")
    batch = _batch(path)
    objective = PolicyObjective(agg="token-mean")
    lora = {"lora_rank": 4, "lora_alpha": 8.0}
    single = HFTrainEngine(path, lr=1e-2, micro_batch_size=3, **lora)
    single.train_step(batch.tensors(), objective)
    cfg = vars(FSDP2TrainEngineConfig(world_size=2, micro_batch_size=3, **lora))
    group = TrainGroup(
        TrainWorker,
        2,
        "ray",
        ray_options=RayOptions(num_cpus=0.5),
        engine=cfg,
        runtime={"model_path": path, "lr": 1e-2, "num_threads": 1, "dist_backend": "gloo"},
    )
    try:
        _call(group.submit(TrainWorker.train, batch, objective, 1, 1, 1.0, 0))
        merged = group.get_weights()
        for name, value in single.get_weights().items():  # merged weights, HF names, after one equal step
            torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-4, msg=name)
        group.save(str(tmp_path / "ckpt"), path)
        group.load(str(tmp_path / "ckpt"))
        again = group.get_weights()
        for name, value in merged.items():
            torch.testing.assert_close(again[name], value, msg=name)
    finally:
        group.shutdown()
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").exists()
    reloaded = HFTrainEngine(path, lr=1e-2, micro_batch_size=3, **lora)
    reloaded.load(tmp_path / "ckpt")  # the 2-rank checkpoint resumes in one process
    for name, value in merged.items():
        torch.testing.assert_close(reloaded.get_weights()[name], value, atol=1e-6, rtol=1e-5, msg=name)
