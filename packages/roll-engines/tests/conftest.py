"""Fixtures shared by roll-engines' tests."""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in tiny Llama (roll_core.models), built into this module's own roll cache. Modules that need
    another tiny model (the MoE ones) define their own `tiny`."""
    from roll_core.models import resolve_model_path

    os.environ["ROLL_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    return resolve_model_path("builtin:tiny")


@pytest.fixture
def tiny_hf_config():
    """`tiny_hf_config(cls, **change)`: a transformers config `cls` (a class name, e.g. "Qwen2Config") of a tiny
    shape (vocab 128, hidden 64, intermediate 96, 2 layers, 4 heads, 2 key/value heads), `change` set over it; no
    model is built."""

    def build(cls: str, **change: Any) -> Any:
        import transformers

        shape = {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
        return getattr(transformers, cls)(**{**shape, **change})

    return build


@pytest.fixture(scope="module")
def megatron_process_group():
    """Megatron engines built in the test process share its process group of one (and Megatron's parallel state);
    leave nothing behind for other modules."""
    yield
    _release_process_group()


def _release_process_group() -> None:
    """Destroy this process's default process group and Megatron's parallel state, those that exist."""
    import sys

    import torch.distributed as dist

    if "megatron.core" in sys.modules:  # (never imported: no parallel state to destroy)
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_process_train_engine():
    """`build(kind, path, **kw)`: a train engine on one process, kind `hf`, `lora`, `fsdp2`, `fsdp2_lora` or
    `megatron` (skipped without roll-engines[megatron]); the LoRA kinds at rank 4, alpha 8; fsdp2 and megatron in a
    gloo group of one. That group and Megatron's parallel state are released after the test: none left behind."""

    def build(kind: str, path: str, **kw: Any) -> Any:
        if kind == "megatron":
            pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
            from roll_engines.train.megatron.engine import MegatronTrainEngine

            return MegatronTrainEngine(path, dist_backend="gloo", use_distributed_optimizer=False, **kw)
        lora = {"lora_rank": 4, "lora_alpha": 8.0} if kind in ("lora", "fsdp2_lora") else {}
        if kind in ("fsdp2", "fsdp2_lora"):
            from roll_engines.train.fsdp2 import FSDP2TrainEngine

            return FSDP2TrainEngine(path, dist_backend="gloo", **kw, **lora)
        if kind not in ("hf", "lora"):
            raise ValueError(f"unknown train engine kind {kind!r}: hf, lora, fsdp2, fsdp2_lora or megatron")
        from roll_engines.train.hf import HFTrainEngine

        return HFTrainEngine(path, **kw, **lora)

    yield build
    _release_process_group()


@pytest.fixture
def vllm_engine_args():
    """`engine_args(path, on_cpu=..., dtype=..., **kw)`: roll_engines.infer._vllm_args.engine_args of a small engine
    (one GPU, 4 sequences of 256 tokens, eager, prefix cache on, half the GPU's memory, seed 0); `kw` adds or
    overrides keywords. Building them needs no vLLM."""
    from roll_engines.infer._vllm_args import engine_args

    def build(path: str, *, on_cpu: bool, dtype: str, **kw: Any) -> dict[str, Any]:
        small: dict[str, Any] = {
            "seed": 0,
            "tensor_parallel_size": 1,
            "max_num_seqs": 4,
            "max_model_len": 256,
            "enforce_eager": True,
            "enable_prefix_caching": True,
            "trust_remote_code": False,
            "gpu_memory_utilization": 0.5,
        }
        return engine_args(path, on_cpu=on_cpu, dtype=dtype, **{**small, **kw})

    return build


@pytest.fixture(scope="session")
def own_routing():
    """`own_routing(path, batch)`: the fp32 hf model's own top-k experts at every position of `batch` (a padded
    forward), (B, P+R, layers, k) int16: what a routing recorded elsewhere is compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    from roll_engines.infer._routing import model_routing

    def own(path: str, batch: dict) -> torch.Tensor:
        return model_routing(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), batch)

    return own
