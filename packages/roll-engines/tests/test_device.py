"""Engines on an accelerator (run by `nox -s device -- cuda|rocm|npu`; skipped on CPU machines)."""

from __future__ import annotations

import pytest
import torch

from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.protocol import build_sequences, pad_left


def _engines(device: str, dtype: str):
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny")
    infer = HFInferEngine(path, device=device, dtype=dtype, max_new_tokens=8)
    train = HFTrainEngine(path, device=device, dtype=dtype, lr=1e-3)
    return infer, train


def _check(device: str) -> None:
    infer, train = _engines(device, "float32")
    ids = [infer.tokenizer("What is 1+1?")["input_ids"]]
    gen = infer.generate(ids, infer.defaults.replace(seed=0), n=4)
    p_ids, p_mask = pad_left(ids * 4, infer.pad_id)
    batch = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    batch.update(
        responses=gen.responses, response_mask=gen.response_mask, advantages=torch.ones(4, 1) * gen.response_mask
    )
    logp = train.compute_logprobs(batch)["logprobs"]
    torch.testing.assert_close(logp * gen.response_mask, gen.logprobs, atol=1e-3, rtol=1e-3)
    metrics = train.train_step(batch, PolicyObjective())
    assert metrics["grad_norm"] > 0
    assert infer.load_weights(train.get_weights()) > 0


@pytest.mark.cuda
def test_hf_engines_on_cuda() -> None:
    _check("cuda")


@pytest.mark.rocm
def test_hf_engines_on_rocm() -> None:
    _check("cuda")  # torch addresses ROCm devices as "cuda"


@pytest.mark.npu
def test_hf_engines_on_npu() -> None:
    _check("npu")


def _fsdp2_rank(rank: int, port: int, path: str, out) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    torch.cuda.reset_peak_memory_stats()
    engine = FSDP2TrainEngine(path, device=f"cuda:{rank}", dist_backend="nccl", lr=1e-3)
    out.put((rank, torch.cuda.max_memory_allocated(), sorted(engine.loaded_on)))
    import torch.distributed as dist

    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.gpus(2)
def test_fsdp2_never_holds_the_full_model_on_a_gpu() -> None:
    """Each rank's GPU holds its shards plus one full tensor while the engine loads, not the whole model (rank 0's
    model stays in host memory until `fully_shard` moves each unit; rank 1 builds it on meta and gets rank 0's
    tensors broadcast one at a time)."""
    import torch.multiprocessing as mp
    from transformers import AutoConfig, AutoModelForCausalLM

    from roll_core.cluster.ports import free_port

    path = resolve_model_path("builtin:tiny")
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = 16  # many units: one layer is a small part of the model
    folder = resolve_model_path("builtin:tiny") + "-16-layers"
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_fsdp2_rank, args=(r, port, folder, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    peaks = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for rank, peak, loaded_on in peaks:
        assert loaded_on == (["cpu"] if rank == 0 else ["meta"]), loaded_on  # rank 0 alone reads the checkpoint
        assert peak < 0.75 * full, (rank, peak, full)
