"""A trainer weight beyond the inference engines' dtype's range (fp16's 65504) fails the weight sync, naming the
tensor, and the engines keep their old weights and version. The cast before bucketing (roll_core.cluster.buckets.cast)
turned it into inf without a word: an fp16 engine then sampled from NaN logits under the new weight version."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from roll_core.cluster.buckets import cast
from roll_core.cluster.roles import InferGroup, InferWorker, TrainWorker
from roll_core.cluster.weight_sync import WeightSync
from roll_core.cluster.worker import Dispatch, dispatch_mode
from roll_core.interfaces import Request, SamplingParams
from roll_core.models import resolve_model_path
from roll_hw.cpu import CpuPlatform

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
PROMPT = [5, 17, 42, 9]


def test_a_finite_weight_that_overflows_the_engine_dtype_is_refused_by_name() -> None:
    big = torch.tensor([1.0, -7.0e4, 3.0])
    with pytest.raises(ValueError, match=r"1 value\(s\) of 'layer.w' overflow torch.float16 \(largest magnitude 70000"):
        list(cast([("ok", torch.ones(2)), ("layer.w", big)], "float16"))
    # In range, in a dtype of fp32's range, or inf already in the trainer's tensor: carried as they are.
    assert cast([("w", torch.tensor([65504.0]))], "float16").__next__()[1].item() == 65504.0
    assert torch.isfinite(next(cast([("w", torch.tensor([1e30]))], "bfloat16"))[1]).all()
    assert torch.isinf(next(cast([("mask", torch.tensor([float("-inf"), 1.0]))], "float16"))[1][0])
    # A weight the engines keep wide (fp32 under fp16) is not narrowed, so nothing overflows.
    assert next(cast([("router", big)], "float16", {"router": "float32"}))[1].dtype == torch.float32


class _Trainer:
    """The trainer's group (one rank, local backend) around a real TrainWorker whose engine yields `weights`."""

    backend, world_size = "local", 1

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights
        self.worker = TrainWorker.__new__(TrainWorker)
        self.worker.rank, self.worker.engine, self.worker.weight_format = 0, self, "merged"

    def iter_weights(self, changed_only: bool = False) -> Any:
        yield from self.weights.items()

    def call(self, method: Any, *args: Any) -> Any:
        out = getattr(self.worker, method.__name__)(*args)
        return out if dispatch_mode(TrainWorker, method.__name__) is Dispatch.RANK0 else [out]


def test_a_sync_whose_weight_overflows_fp16_leaves_the_engine_on_its_old_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    import roll_core.cluster.engine_worker as engine_worker
    from roll_engines.config import HFInferEngineConfig

    # An fp16 engine as on a GPU (the CPU platform turns fp16 into fp32: it has no fast fp16).
    resolve = engine_worker.resolve_device
    monkeypatch.setattr(engine_worker, "resolve_device", lambda runtime: {**resolve(runtime), "dtype": "float16"})

    path = resolve_model_path("builtin:tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    weights = {k: v.detach() + 0.5 * torch.randn(v.shape, generator=gen) for k, v in model.named_parameters()}
    last = [k for k, v in weights.items() if v.dim() == 2][-2]  # late in the sync: buckets before it were applied
    weights[last][0, 0] = 1.0e5
    runtime = {"model_path": path, "max_new_tokens": 6, "dtype": "float16", "num_threads": 1}
    infer = InferGroup(InferWorker, 1, "local", engine=vars(HFInferEngineConfig()), runtime=runtime)
    try:
        trainer = _Trainer(weights)
        sync = WeightSync(
            trainer, infer, transport="auto", bucket_mb=4 / 1024, placement="colocated", platform=CpuPlatform
        )
        assert sync.dtype == "float16"
        before = infer.submit_request(Request("b", PROMPT, GREEDY)).result(60)
        with pytest.raises(ValueError, match=rf"of '{last}' overflow torch.float16"):
            sync.sync()
        after = infer.submit_request(Request("a", PROMPT, GREEDY)).result(60)
        assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
        assert after.weight_version == before.weight_version
        engine = infer.workers[0].engine
        assert all(torch.isfinite(t).all() for t in engine.model.state_dict().values())

        weights[last][0, 0] = 1.0  # back in range: the sync goes through and counts a version
        sync.sync()
        synced = infer.submit_request(Request("s", PROMPT, GREEDY)).result(60)
        assert synced.weight_version == before.weight_version + 1
        assert all(map(lambda x: x == x, synced.logprobs))  # no NaN
    finally:
        infer.shutdown()
