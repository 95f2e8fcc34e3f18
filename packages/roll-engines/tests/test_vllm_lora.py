"""The `vllm` engine serving the trainer's LoRA adapter (infer_engine.lora_sync=adapter), in vLLM's venv (CPU build).

One engine with LoRA serving (rank 4, vLLM's bound 8), in the GPU's process layout as test_vllm.py runs it (the
engine core in its own process, so adapters reach it through vLLM's `add_lora` across processes). The reference
is roll's hf inference engine loaded with the trainer's merged weights: after an adapter sync vLLM's greedy tokens
and log-probs equal it; a second sync with a changed adapter follows the new merged weights; a request running
across a sync stays on the adapter it started with; merged weights sent to this engine are refused.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")
pytest.importorskip("peft", reason="the trainer's LoRA needs peft (roll-engines[lora]) in vLLM's venv")

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the GPU layout (test_vllm.py's module docstring)
_ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if _ON_CUDA else "cpu"
ATOL = 1e-4  # test_vllm.py's logprob_atol


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from roll_core.models import resolve_model_path

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return resolve_model_path("builtin:tiny-wide")  # vLLM's CPU attention needs heads of >= 32 dimensions


@pytest.fixture(scope="module")
def roles(path: str):
    """The trainer (hf, LoRA rank 4, alpha 16: scaling 4) and the vLLM engine as a run wires them (local backend:
    roll_core.config.lora_sync gives the engine its rank), and the run's WeightSync between them."""
    from roll_core.cluster.roles import InferGroup, InferWorker, TrainGroup, TrainWorker
    from roll_core.cluster.weight_sync import WeightSync
    from roll_core.config.lora_sync import adapter_rank
    from roll_engines.config import HFTrainEngineConfig, VLLMInferEngineConfig
    from roll_hw.cpu import CpuPlatform

    te = HFTrainEngineConfig(lora_rank=4, lora_alpha=16.0)
    ie = VLLMInferEngineConfig(max_model_len=256, kv_cache_gb=1, max_num_seqs=8, lora_sync="adapter")
    if _ON_CUDA:
        ie.gpu_memory_utilization = 0.3
    train = TrainGroup(TrainWorker, 1, "local", engine=vars(te), runtime={"model_path": path, "lr": 5e-2})
    runtime = {"model_path": path, "max_new_tokens": 16, "seed": 0, "device": DEVICE, "lora_rank": adapter_rank(te, ie)}
    infer = InferGroup(InferWorker, 1, "local", engine=vars(ie), runtime=runtime)
    try:
        sync = WeightSync(train, infer, transport="auto", bucket_mb=0.05, placement="colocated", platform=CpuPlatform)
        yield train.workers[0].engine, infer.workers[0].engine, sync
    finally:
        train.shutdown()
        infer.shutdown()


def _step(train: Any, path: str, seed: int) -> None:
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch

    torch.manual_seed(seed)
    train.train_step(toy_batch(path), PolicyObjective())


def test_adapter_sync_equals_the_merged_model_and_follows_the_next_adapter(roles: Any, path: str) -> None:
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine

    train, engine, sync = roles
    assert sync.weight_format == engine.weight_format == "adapter"
    hf = HFInferEngine(path, device=DEVICE)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    base = engine.generate(prompts, greedy)
    seen = []
    for version, seed in ((1, 0), (2, 1)):
        _step(train, path, seed)
        stats = sync.sync()  # the first sync of a run is "full": the adapter alone all the same
        assert stats.version == version and stats.buckets > 1  # 0.05 MiB buckets: the adapter arrives in parts
        hf.load_weights({k: v.detach().clone() for k, v in train.iter_weights()})  # the merged model
        got, ref = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
        assert got.responses.tolist() == ref.responses.tolist()
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=ATOL, rtol=0)
        seen.append(got.logprobs)
        # What crossed: the adapter alone (r x (in + out) per adapted layer), not the adapted weights.
        adapter = sum(v.numel() * 4 for _, v in train.iter_adapter())
        adapted = sum(v.numel() * 4 for _, v in train.iter_weights(changed_only=True))
        assert stats.bytes == engine.last_sync["bytes"] == adapter < adapted / 30
        # The superseded adapter is gone (no request uses it), its folder deleted; the new one serves.
        assert set(engine.engine.list_loras()) == {version}
        assert sorted(p.name for p in engine._adapters.root.iterdir()) == [f"v{version}"]
    assert (seen[0] - base.logprobs).abs().max() > 1e-3 and (seen[1] - seen[0]).abs().max() > 1e-3


def test_a_request_running_across_a_sync_keeps_its_adapter(roles: Any, path: str) -> None:
    """vLLM fixes a request's adapter when it starts: the request finishes on it and reports its version; the
    superseded adapter is removed only once that request is done."""
    from roll_core.interfaces import Request, SamplingParams

    train, engine, sync = roles
    v = sync.sync().version
    greedy = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], greedy).responses[0].tolist()
    _step(train, path, 4)
    running = engine.submit(Request("long", [5, 6, 7], greedy))  # queued before the sync's pause: it starts first
    assert sync.sync().version == v + 1
    assert not running.done() and set(engine.engine.list_loras()) == {v, v + 1}
    out = running.result(timeout=120)
    assert out.weight_version == v and out.token_ids == alone
    assert engine.generate([[5, 6, 7]], greedy).responses[0].tolist() != alone  # new requests: the new adapter
    assert set(engine.engine.list_loras()) == {v + 1}


def test_merged_weights_are_refused(roles: Any) -> None:
    train, engine, _ = roles
    version = engine._version
    engine.begin_weight_update()
    with pytest.raises(ValueError, match=r"lora_sync=adapter takes LoRA adapter matrices.*model\.embed_tokens"):
        engine.update_weights(list(train.iter_weights())[:2])
    assert engine.finish_weight_update() == version + 1  # the failed sync ends; nothing was loaded
    assert set(engine.engine.list_loras()) == {engine._adapters.current} == {version}


def test_an_aborted_adapter_sync_loads_nothing(roles: Any) -> None:
    """Part of an adapter arrived, then the sender failed: `abort_weight_update` loads no adapter, keeps the
    version and the adapter that serves (a finish would have loaded what arrived, or failed on it, as a new version)."""
    from roll_core.interfaces import SamplingParams

    train, engine, _ = roles
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before, version, loras = engine.generate([[5, 6, 7]], greedy), engine._version, set(engine.engine.list_loras())
    engine.begin_weight_update()
    engine.update_weights(list(train.iter_adapter())[:2])
    assert engine.abort_weight_update("the trainer died") == version
    assert set(engine.engine.list_loras()) == loras
    assert torch.equal(engine.generate([[5, 6, 7]], greedy).responses, before.responses)
    with pytest.raises(RuntimeError, match="outside begin_weight_update"):  # the aborted sync takes nothing more
        engine.update_weights(list(train.iter_adapter())[2:4])


def test_an_adapter_id_is_never_reused_for_another_adapter(roles: Any, path: str, monkeypatch) -> None:
    """vLLM keeps the adapter it holds under an id and does not reload it when asked to add that id again. A sync
    whose adapter vLLM loaded and that then failed (its prefix-cache reset), or whose `add_lora` failed after a
    worker had loaded it, kept the version, so the next sync reused the id: vLLM served the failed sync's adapter
    instead of the new one. Now the next sync's adapter serves (equal to the merged model)."""
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine

    train, engine, _ = roles
    hf = HFInferEngine(path, device=DEVICE)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    real_add = engine.engine.add_lora

    def fails_after_loading(request: Any) -> object:
        real_add(request)  # as a worker that loaded it while another failed
        raise RuntimeError("a worker failed to load the adapter")

    def fails(*_: Any, **__: Any) -> bool:
        raise RuntimeError("the prefix cache reset failed")

    for seed, (obj, attr, broken) in enumerate(
        [(engine, "_reset_prefix_cache", fails), (engine.engine, "add_lora", fails_after_loading)], start=10
    ):
        _step(train, path, seed)
        with monkeypatch.context() as patch:
            patch.setattr(obj, attr, broken)
            engine.begin_weight_update()
            engine.update_weights(list(train.iter_adapter()))
            with pytest.raises(RuntimeError, match="failed"):
                engine.finish_weight_update()
        _step(train, path, seed + 100)  # a new adapter, synced under the next id
        engine.begin_weight_update()
        engine.update_weights(list(train.iter_adapter()))
        version = engine.finish_weight_update()
        assert set(engine.engine.list_loras()) == {engine._adapters.current} == {version}
        hf.load_weights({k: v.detach().clone() for k, v in train.iter_weights()})  # the merged model
        got, ref = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
        assert got.responses.tolist() == ref.responses.tolist()
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=ATOL, rtol=0)
