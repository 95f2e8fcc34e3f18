"""CUDA IPC weight sync between two processes on one GPU, without Ray (the device machine has none).

Run by `nox -s device -- cuda`; skipped elsewhere. The trainer process shares each bucket's flat device buffer as a
CUDA IPC handle; the engine process rebuilds it without a host copy and loads it into an inference engine (hf,
vLLM, SGLang: each must copy what it received into memory it owns, since the sender reuses its buffer and torch
refuses to re-share a received tensor, which SGLang's `update_weights_from_tensor` does), whose greedy output must
then equal the trainer model's. The receiving side synchronises before acknowledging, as `InferWorker` does.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.cuda
ENGINES = ("hf", "vllm", "sglang")


def _build(kind: str, path: str):
    if kind == "hf":
        from roll_engines.infer.hf import HFInferEngine

        return HFInferEngine(path, device="cuda")
    if kind == "vllm":
        from roll_engines.infer.vllm import VLLMInferEngine

        return VLLMInferEngine(path, device="cuda", max_model_len=512, gpu_memory_utilization=0.2)
    from roll_engines.infer.sglang import SGLangInferEngine

    return SGLangInferEngine(path, dtype="float32", mem_fraction_static=0.2, disable_cuda_graph=True)


def _engine_side(kind: str, handles: mp.Queue, results: mp.Queue, path: str) -> None:
    from roll_core.cluster.weight_sync import open_cuda
    from roll_core.interfaces import SamplingParams

    engine = _build(kind, path)
    engine.begin_weight_update()
    while (item := handles.get()) is not None:
        bucket = open_cuda(item["handle"], item["specs"])
        engine.update_weights(bucket)
        torch.cuda.synchronize()
        del bucket
        results.put("copied")
    engine.finish_weight_update()
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    results.put(out.responses[0].tolist())
    engine.shutdown()


@pytest.mark.parametrize("kind", ENGINES)
def test_cuda_ipc_buckets_reach_an_engine_in_another_process(kind: str) -> None:
    if kind != "hf":
        pytest.importorskip(kind, reason=f"pip install 'roll-engines[{kind}]'")
    from roll_core.cluster.weight_sync import buckets, share_cuda
    from roll_core.interfaces import SamplingParams
    from roll_core.models import resolve_model_path
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny-wide")  # vLLM's and SGLang's kernels need heads of >= 64 dimensions
    train = HFTrainEngine(path, device="cuda")
    with torch.no_grad():
        for p in train.model.parameters():
            p.mul_(1.5)  # weights the engine's own copy of the model does not have
    ctx = mp.get_context("spawn")
    handles, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine_side, args=(kind, handles, results, path))
    proc.start()
    for bucket in buckets(train.iter_weights(), 64 * 1024):
        handle, specs, keep = share_cuda(bucket)
        handles.put({"handle": handle, "specs": specs})
        assert results.get(timeout=300) == "copied"  # the buffer may be freed only after the copy
        del keep
    handles.put(None)
    got = results.get(timeout=300)
    proc.join(timeout=60)
    expected = HFInferEngine(path, device="cuda")
    expected.load_weights(dict(train.iter_weights()))
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    assert got == expected.generate([[5, 6, 7]], greedy).responses[0].tolist()


def test_an_nccl_sync_group_takes_the_sync_timeout() -> None:
    """`infer_engine.sync_timeout_s` reaches NCCL's group (its Options' timeout; without them NCCL waits its own
    10-minute default whatever the sync asked), and such a group broadcasts (one rank: the call's signature and
    options are what a CUDA torch accepts)."""
    import datetime

    import torch.distributed as dist

    from roll_core.cluster.buckets import SyncGroup, nccl_options

    timeout = datetime.timedelta(seconds=7)
    assert nccl_options(dist, timeout)._timeout == timeout
    store = SyncGroup.host_store("127.0.0.1", 1, timeout_s=7)
    group = SyncGroup("127.0.0.1", store.port, 0, 1, "nccl", timeout_s=7, store=store)
    t = torch.arange(4, device="cuda", dtype=torch.float32)
    group.broadcast(t)
    torch.cuda.synchronize()
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
