"""An inference engine process that dies mid-generation fails the call with the role, rank and node named."""

from __future__ import annotations

import pytest

from roll_core.cluster.group import RayOptions, WorkerDiedError
from roll_core.cluster.roles import InferGroup, InferWorker
from roll_core.interfaces import SamplingParams
from roll_core.models import resolve_model_path
from roll_core.protocol import Batch

pytestmark = pytest.mark.ray


def test_dead_engine_names_role_rank_and_node(ray_cluster) -> None:
    import ray

    from roll_engines.config import HFInferEngineConfig

    path = resolve_model_path("builtin:tiny")
    group = InferGroup(
        InferWorker,
        2,
        "ray",
        name="actor_infer",
        ray_options=RayOptions(num_cpus=0.5),
        engine=vars(HFInferEngineConfig()),
        runtime={"model_path": path, "num_threads": 1},
    )
    try:
        prompts = Batch(fields={"prompt_ids": [[5, 6, 7]] * 4})
        long = SamplingParams(max_new_tokens=100_000, ignore_eos=True, seed=0)
        handle = group.submit(InferWorker.generate, prompts, long, 2)
        # Killed at once: the call is under way either way (queued at the worker or generating its 4 x 509 tokens).
        # A fixed wait here let a stalled test thread find the generation already finished, the call then a success.
        ray.kill(group.workers[1])
        with pytest.raises(WorkerDiedError, match=r"actor_infer rank 1 on node [0-9a-f]+ died during generate"):
            handle.values()
    finally:
        group.shutdown()
