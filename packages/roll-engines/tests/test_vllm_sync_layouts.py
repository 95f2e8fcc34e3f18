"""Weight syncs into the `vllm` engine for model layouts the conformance suite's model does not have, in vLLM's venv
(CPU build), the engine core in its own process (the GPU layout, as test_vllm.py runs it; (d), (e) in this one).

(a) Tied input and output embeddings (SmolLM2, Qwen2.5-0.5B/1.5B, Qwen3-0.6B): the trainer sends the shared tensor
    once, under the embedding's name; after a sync of changed weights vLLM's greedy tokens and log-probs equal roll's
    hf engine loaded with the same weights (vLLM-CPU's LM head kept a packed copy of the weight it was loaded with).
(b) A LoRA policy adapting only some of a fused group (q_proj and v_proj, not k_proj; vLLM serves q|k|v as one
    layer and reloads a layer whole): a merged sync of only the changed weights keeps vLLM equal to the hf engine
    (the parts not sent used to be refilled from uninitialised memory).
(c) A Qwen3-MoE: vLLM-CPU prepacks its experts for its grouped GEMM at load and skipped that on a weight update, so
    after any sync (unchanged weights included) its tokens differed from transformers'.
(d) A multimodal model's encoder cache: after a sync neither the scheduler nor the worker keeps a picture's features.
(e) A GLM-4.5-style router, which vLLM keeps in fp32 under bf16, is synced in fp32 (it was rounded to bf16).
(f) A sync that fails part way (aborted by its sender, or a weight the worker rejects) is undone in the worker: every
    parameter and packed kernel as before, fused groups (q|k|v, gate|up) included; the version is kept. Where the
    undo itself fails the engine refuses to serve the mix of versions until a full sync.
(g) After sleep(level=2) the engine refuses until completed syncs have rewritten every layer, a fused one only once
    all its parts were sent, and layers no full sync writes do not keep it refusing.
(h) A nonzero bias the engine's model has no parameter for (a mismatched layout) fails the sync, naming it, and is
    undone; a zero one is dropped (vLLM dropped every such bias, the sync completed on the engine's old layout).
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


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch):
    """vLLM's engine core in this process (the CPU default), to read its scheduler; the module's other engines keep
    their own process: vLLM caches its environment once an engine core starts, so the cache is dropped around."""
    import vllm.envs

    vllm.envs.disable_envs_cache()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    yield
    vllm.envs.disable_envs_cache()


def test_a_sync_resets_the_encoder_cache_on_both_sides(tmp_path, in_process) -> None:
    """(d) A multimodal model's encoder outputs (a picture's features) are shared across requests: the scheduler
    records which pictures are cached, the workers hold the features. vLLM's reload clears the workers' copies
    only, so a picture seen before a sync was then scheduled as cached and failed its request ("Encoder cache
    miss") on a GPU. vLLM-CPU cannot serve a vision model here (no torchvision), so a text engine, marked multimodal
    as a VLM engine is, holds a picture's entry on both sides; after a sync neither side has it."""
    from transformers import AutoModelForCausalLM

    from roll_core.interfaces import SamplingParams
    from roll_core.models import build_tiny_model
    from roll_engines.infer.vllm import VLLMInferEngine

    build_tiny_model(tmp_path, hidden=128, heads=4, kv_heads=2)
    engine = VLLMInferEngine(str(tmp_path), **ENGINE)
    try:
        # A text model: vLLM keeps no encoder outputs, nothing to reset.
        assert not getattr(engine, "_multimodal", False)
        engine._multimodal = True  # as for a vision-language model
        core = engine.engine.engine_core.engine_core  # in process: the scheduler and the worker are reachable
        cached, runner = core.scheduler.encoder_cache_manager, core.model_executor.driver_worker.worker.model_runner
        # A picture whose requests finished: freeable in the scheduler's record, its features in the worker.
        cached.cached["picture"], cached.num_embeds_by_hash["picture"], cached.freeable["picture"] = set(), 4, 4
        runner.encoder_cache["picture"] = torch.zeros(4, 128)
        weights = AutoModelForCausalLM.from_pretrained(tmp_path).named_parameters()
        _sync(engine, [(k, v.detach()) for k, v in weights])
        assert "picture" not in runner.encoder_cache  # vLLM's reload cleared the worker's copy...
        assert "picture" not in cached.cached and not cached.freeable  # ...and the scheduler no longer lists it
        greedy = SamplingParams(temperature=0, max_new_tokens=4)
        assert engine.generate(PROMPTS, greedy).responses.shape[0] == 2
    finally:
        engine.shutdown()


def test_a_router_kept_in_fp32_is_synced_unrounded(tmp_path, in_process) -> None:
    """(e) vLLM keeps a GLM-4.5 (or DeepSeek-V3) router and its expert-score bias in fp32 under bf16: the engine says
    so (`weight_dtypes`, which the trainer's cast follows) and stages them in fp32; the staging cast them to bf16, so
    after every sync vLLM routed with rounded values."""
    from transformers import AutoModelForCausalLM

    from roll_core.models import resolve_model_path
    from roll_core.testing.models import FP32_ROUTER_KEYS, tiny_fp32_router_moe
    from roll_engines.infer.vllm import VLLMInferEngine

    tiny_fp32_router_moe(tmp_path, resolve_model_path("builtin:tiny"), hidden_size=128, head_dim=32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    router = FP32_ROUTER_KEYS
    engine = VLLMInferEngine(str(tmp_path), dtype="bfloat16", **ENGINE)
    try:
        fp32 = dict.fromkeys(router, "float32")
        assert getattr(engine, "weight_dtypes", lambda: fp32)() == fp32
        # What the trainer sends: fp32 for those two (off the bf16 grid, as trained weights are), bf16 for the rest.
        sent = {k: v + 1e-3 * torch.randn_like(v) for k, v in model.state_dict().items() if k in router}
        rest = [(k, v.to(torch.bfloat16)) for k, v in model.state_dict().items() if k not in router]
        _sync(engine, [*rest, *sent.items()])
        assert engine.last_sync["dtypes"] == ["bfloat16", "float32"]  # the router crossed in fp32
        core = engine.engine.engine_core.engine_core
        mlp = core.model_executor.driver_worker.worker.model_runner.model.model.layers[1].mlp
        bias, weight = sent["model.layers.1.mlp.gate.e_score_correction_bias"], sent["model.layers.1.mlp.gate.weight"]
        assert mlp.gate.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(mlp.gate.e_score_correction_bias.cpu(), bias)
        # vLLM-CPU packs the router's weight for its GEMM (the parameter itself is emptied): probe its product.
        x = torch.randn(3, 128)
        got = mlp.gate(x)[0]
        torch.testing.assert_close(got, x @ weight.T, atol=1e-5, rtol=0)
        assert (got - x @ weight.to(torch.bfloat16).float().T).abs().max() > 1e-4  # what a bf16 router gives
    finally:
        engine.shutdown()


def _worker_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of vLLM's model, and the product of every packed CPU kernel (vLLM-CPU empties the
    parameters of the linears it packs: their weights live in `cpu_linear` only) with a fixed input."""
    state = {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    g = torch.Generator().manual_seed(0)
    for name, m in model.named_modules():
        if hasattr(m, "cpu_linear"):
            x = torch.randn(3, m.input_size_per_partition, generator=g)
            state[f"{name}:cpu_linear"] = m.cpu_linear(x, m.weight, getattr(m, "bias", None)).clone()
    return state


def test_a_sync_that_fails_part_way_is_undone_in_the_worker(tmp_path, in_process) -> None:
    """(f) Buckets that complete some layers (embedding, layer 0) and bring part of a fused group (layer 1's q of
    q|k|v), then an abort: vLLM's worker had written those layers (the partial one with uninitialised k and v at the
    abort) and the engine served them under a new version. Now its weights, kernels and greedy outputs are
    bit-identical to before and the version stays; the same for a bucket the worker rejects (a wrong shape). An
    undo that fails leaves the worker a mix of both versions: every request is refused with an error naming the
    sync (it served the mix), a sync of one layer does not lift it, and a full sync afterwards loads and serves.
    (g) After sleep(level=2) (on a GPU vLLM discards the weights; on CPU it keeps them and the engine refuses all the
    same) every request is refused until completed syncs have rewritten every layer: a partial sync and a failed
    one leave it refused (it served, from garbage on a GPU), a full sync serves; the error names layers left. A
    fused layer (q|k|v) that a sync brought only q of stays unwritten (it counted as rewritten: vLLM filled k and v
    from uninitialised memory and the engine served). A vLLM parameter no trainer tensor maps to (a VLM's, an FP8
    model's) is not waited for once a full sync completed (the engine refused forever), nor after later sleeps."""
    from transformers import AutoModelForCausalLM

    from roll_core.interfaces import Request, SamplingParams
    from roll_core.models import build_tiny_model
    from roll_engines.infer.vllm import VLLMInferEngine

    build_tiny_model(tmp_path, hidden=128, heads=4, kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.manual_seed(0)
    new = {k: p.detach() + 0.05 * torch.randn_like(p) for k, p in model.named_parameters()}
    first = [(k, v) for k, v in new.items() if "embed" in k or ".layers.0." in k]
    part = [(k, v) for k, v in new.items() if ".layers.1.self_attn.q_proj" in k]
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    engine = VLLMInferEngine(str(tmp_path), **ENGINE)
    try:
        core = engine.engine.engine_core.engine_core
        worker_model = core.model_executor.driver_worker.worker.model_runner.model
        before, state = engine.generate(PROMPTS, greedy), _worker_state(worker_model)
        version = engine.submit(Request("v", PROMPTS[0], greedy)).result().weight_version

        def same_as_before() -> None:
            now = _worker_state(worker_model)
            assert now.keys() == state.keys()
            assert [k for k in state if not torch.equal(now[k], state[k])] == []
            after = engine.generate(PROMPTS, greedy)
            assert torch.equal(after.responses, before.responses)
            assert torch.equal(after.logprobs, before.logprobs)
            assert engine.submit(Request("v", PROMPTS[0], greedy)).result().weight_version == version

        engine.begin_weight_update()
        engine.update_weights(first)
        engine.update_weights(part)
        assert engine.abort_weight_update("the trainer died") == version
        same_as_before()

        engine.begin_weight_update()
        engine.update_weights(first)
        engine.update_weights([("model.layers.1.mlp.down_proj.weight", torch.zeros(3, 3))])  # acked, then rejected
        with pytest.raises(Exception, match=r"closed its connection|stopped|size|shape"):
            engine.update_weights(part)
        assert engine.abort_weight_update("a bucket failed") == version
        same_as_before()

        from roll_engines.infer import _vllm_worker

        def lost(_undo: object) -> int:
            raise RuntimeError("device lost during the undo")

        with pytest.MonkeyPatch.context() as patch:  # the worker runs in this process (in_process)
            patch.setattr(_vllm_worker._LayerUndo, "undo", lost)
            engine.begin_weight_update()
            engine.update_weights(first)
            engine.update_weights(part)
            assert engine.abort_weight_update("the trainer died") == version
        mixed = rf"mix of two versions since the weight sync to version {version + 1} failed part way .*could not be"
        with pytest.raises(RuntimeError, match=mixed):
            engine.generate(PROMPTS, greedy)
        _sync(engine, first[:1])  # the embedding alone: layer 0 stays mixed
        with pytest.raises(RuntimeError, match=mixed):
            engine.submit(Request("v", PROMPTS[0], greedy))

        _sync(engine, list(new.items()))
        _assert_same(engine, str(tmp_path), new)

        # (g) 15 layers: embedding, final norm, head, and per decoder layer q|k|v, o, gate|up, down and two norms.
        discarded = r"its weights were discarded by sleep\(level=2\); a weight sync that sends every weight must come"
        engine.sleep(level=2)
        engine.wake_up()
        with pytest.raises(RuntimeError, match=rf"{discarded}.*\(15 still to be rewritten\)"):
            engine.generate(PROMPTS, greedy)
        _sync(engine, first)  # completes: the embedding and layer 0's six layers are rewritten
        left = "lm_head, model.layers.1.input_layernorm, model.layers.1.mlp.down_proj, "
        left += r"model.layers.1.mlp.gate_up_proj, model.layers.1.post_attention_layernorm, \.\.\.$"  # 5 named of 8
        with pytest.raises(RuntimeError, match=rf"{discarded}.*\(8 still to be rewritten\).*not rewritten yet: {left}"):
            engine.submit(Request("v", PROMPTS[0], greedy))
        rest = [(k, v) for k, v in new.items() if k not in dict(first)]
        engine.begin_weight_update()
        engine.update_weights(rest)  # every other layer, then the sender dies: nothing more is lifted
        engine.abort_weight_update("the trainer died")
        with pytest.raises(RuntimeError, match=rf"{discarded}.*\(8 still to be rewritten\)"):
            engine.generate(PROMPTS, greedy)
        _sync(engine, list(new.items()))
        _assert_same(engine, str(tmp_path), new)

        # A vLLM layer no trainer tensor maps to, then a full sync: the engine serves again, and the next sleep
        # leaves that layer out.
        worker_model.roll_probe = torch.nn.Linear(2, 2, bias=False)
        engine.sleep(level=2)
        engine.wake_up()
        with pytest.raises(RuntimeError, match=rf"{discarded}.*\(16 still to be rewritten\)"):
            engine.generate(PROMPTS, greedy)
        _sync(engine, list(new.items()))
        _assert_same(engine, str(tmp_path), new)

        # Every weight but layer 1's k and every v: layer 0's q|k|v got q and k, layer 1's q alone: both unwritten.
        engine.sleep(level=2)
        engine.wake_up()
        with pytest.raises(RuntimeError, match=rf"{discarded}.*\(15 still to be rewritten\)"):
            engine.generate(PROMPTS, greedy)
        no_kv = [(k, v) for k, v in new.items() if not (".layers.1.self_attn.k_proj" in k or ".v_proj" in k)]
        assert len(no_kv) == len(new) - 3
        _sync(engine, no_kv)
        qkv = r"not rewritten yet: model.layers.0.self_attn.qkv_proj, model.layers.1.self_attn.qkv_proj$"
        with pytest.raises(RuntimeError, match=rf"{discarded}.*\(2 still to be rewritten\).*{qkv}"):
            engine.generate(PROMPTS, greedy)
        _sync(engine, [(k, v) for k, v in new.items() if ".layers.0.self_attn." in k or ".layers.1.self_attn" in k])
        _assert_same(engine, str(tmp_path), new)
    finally:
        engine.shutdown()


def test_a_bias_the_engine_lacks_is_refused_unless_zero(tmp_path) -> None:
    """(h) A Llama engine (no attention biases) sent q_proj and o_proj biases, as a Qwen2-layout converter might:
    vLLM drops any bias its model lacks (for GPTQ checkpoints' zero biases: its fused q|k|v layer's loader and its
    generic one), so the sync completed, the version moved and the engine served without the trainer's biases. Now
    a nonzero one fails the sync naming it (trainer and vLLM names) and the engine serves on unchanged; zero ones
    change nothing and the sync completes."""
    from transformers import AutoModelForCausalLM

    from roll_core.interfaces import Request, SamplingParams
    from roll_core.models import build_tiny_model
    from roll_engines.infer.vllm import VLLMInferEngine

    build_tiny_model(tmp_path, hidden=128, heads=4, kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.manual_seed(0)
    new = {k: p.detach() + 0.05 * torch.randn_like(p) for k, p in model.named_parameters()}
    names = list(new)
    at = names.index("model.layers.1.self_attn.q_proj.weight")  # after layer 0: written, then undone
    biases = {"q_proj": "model.layers.0.self_attn.q_proj.bias", "o_proj": "model.layers.0.self_attn.o_proj.bias"}
    vllm_names = {
        "q_proj": r"model\.layers\.0\.self_attn\.qkv_proj\.bias",
        "o_proj": r"(model\.)?layers\.0\.self_attn\.o_proj\.bias",
    }
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    engine = VLLMInferEngine(str(tmp_path), **ENGINE)
    try:
        before = engine.generate(PROMPTS, greedy)
        version = engine.submit(Request("v", PROMPTS[0], greedy)).result().weight_version
        for module, bias in biases.items():
            sent = (
                [(k, new[k]) for k in names[:at]]
                + [(bias, torch.full((128,), 0.5))]
                + [(k, new[k]) for k in names[at:]]
            )
            engine.begin_weight_update()
            with pytest.raises(
                Exception, match=rf"{module}\.bias.*no parameter '{vllm_names[module]}' for this nonzero"
            ):
                engine.update_weights(sent)
                engine.finish_weight_update()
            assert engine.abort_weight_update("refused") == version
            after = engine.generate(PROMPTS, greedy)
            assert torch.equal(after.responses, before.responses) and torch.equal(after.logprobs, before.logprobs)

        zeros = [(bias, torch.zeros(128)) for bias in biases.values()]
        _sync(engine, [(k, new[k]) for k in names[:at]] + zeros + [(k, new[k]) for k in names[at:]])
        assert engine.submit(Request("v", PROMPTS[0], greedy)).result().weight_version == version + 1
        _assert_same(engine, str(tmp_path), new)
    finally:
        engine.shutdown()
