"""Fixtures shared by roll-engines' tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in tiny Llama (roll_core.models), built into this module's own roll cache. Modules that need
    another tiny model (the MoE ones) define their own `tiny`."""
    from roll_core.models import resolve_model_path

    os.environ["ROLL_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    return resolve_model_path("builtin:tiny")


@pytest.fixture(scope="module")
def megatron_process_group():
    """Megatron engines built in the test process share its process group of one (and Megatron's parallel state);
    leave nothing behind for other modules."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


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
