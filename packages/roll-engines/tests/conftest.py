"""Fixtures shared by roll-engines' tests."""

from __future__ import annotations

import pytest


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
