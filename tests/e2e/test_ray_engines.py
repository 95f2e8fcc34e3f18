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
        assert [r[:2] for r in group.call("ping")] == [(0, 2), (1, 2)]
        pids = {r[2] for r in group.call("ping")}
        assert len(pids) == 2  # two processes
        got = group.call("compute_gradients", batch, objective)[0]  # uneven split: 3 + 3 rows
        assert set(got) == set(expected)
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-4, msg=name)
        # full weights gather on rank 0 and equal the single engine's initial weights
        weights = group.get_weights()
        for k, v in single.get_weights().items():
            torch.testing.assert_close(weights[k], v)
    finally:
        group.shutdown()
