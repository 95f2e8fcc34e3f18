"""The `megatron` engine (Megatron-Core on CPU over gloo): the TrainEngine conformance suite at TP=PP=1 in this
process; TP=2 and PP=2 against the `hf` engine run on Ray in tests/e2e/test_megatron_ray.py."""

from __future__ import annotations

from typing import Any

import pytest

from roll_core.testing.train_engine import TrainEngineTestSuite

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")


@pytest.fixture(scope="module", autouse=True)
def _one_process_group():
    """The engines here share this process's group of one; leave nothing behind for other modules."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class TestMegatronTrainEngine(TrainEngineTestSuite):
    logprob_atol = 1e-5

    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any):
        from roll_engines.train.megatron import MegatronTrainEngine

        kwargs.setdefault("micro_batch_size", 4)
        return MegatronTrainEngine(model_path, dist_backend="gloo", use_distributed_optimizer=False, **kwargs)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recomputation_gives_the_same_gradients(recompute: str, tmp_path_factory) -> None:
    import os

    import torch

    from roll_core.models import resolve_model_path
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.megatron import MegatronTrainEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    path = resolve_model_path("builtin:tiny")
    batch, objective = toy_batch(path), PolicyObjective()
    common = {"dist_backend": "gloo", "use_distributed_optimizer": False, "micro_batch_size": 3}
    plain = MegatronTrainEngine(path, **common).compute_gradients(batch, objective)
    again = MegatronTrainEngine(path, recompute=recompute, **common).compute_gradients(batch, objective)
    for name, g in plain.items():
        torch.testing.assert_close(again[name], g, atol=1e-6, rtol=1e-5, msg=name)
