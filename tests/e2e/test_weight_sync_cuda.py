"""CUDA IPC weight sync between two processes on one GPU, without Ray (the device machine has none).

Run by `nox -s device -- cuda`; skipped elsewhere. The trainer process shares each bucket's flat device buffer as a
CUDA IPC handle; the engine process rebuilds it without a host copy and loads it into an `hf` inference engine,
whose greedy output must then equal the trainer model's.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.cuda


def _engine_side(handles: mp.Queue, results: mp.Queue, path: str) -> None:
    from roll_core.cluster.weight_sync import open_cuda
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine

    engine = HFInferEngine(path, device="cuda")
    engine.begin_weight_update()
    while (item := handles.get()) is not None:
        engine.update_weights(open_cuda(item["handle"], item["specs"]))
        results.put("copied")
    engine.finish_weight_update()
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=8))
    results.put(out.responses[0].tolist())


def test_cuda_ipc_buckets_reach_an_engine_in_another_process() -> None:
    from roll_core.cluster.weight_sync import buckets, share_cuda
    from roll_core.interfaces import SamplingParams
    from roll_core.models import resolve_model_path
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny")
    train = HFTrainEngine(path, device="cuda")
    with torch.no_grad():
        for p in train.model.parameters():
            p.mul_(1.5)  # weights the engine's own copy of the model does not have
    ctx = mp.get_context("spawn")
    handles, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine_side, args=(handles, results, path))
    proc.start()
    for bucket in buckets(train.iter_weights(), 64 * 1024):
        handle, specs, keep = share_cuda(bucket)
        handles.put({"handle": handle, "specs": specs})
        assert results.get(timeout=120) == "copied"  # the buffer may be freed only after the copy
        del keep
    handles.put(None)
    got = results.get(timeout=120)
    proc.join(timeout=60)
    expected = HFInferEngine(path, device="cuda")
    expected.load_weights(dict(train.iter_weights()))
    ref = expected.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=8)).responses[0].tolist()
    assert got == ref
