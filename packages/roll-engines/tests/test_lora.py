"""LoRA (peft) on the training engines: only adapters train, the base with adapters off is the reference,
weight sync and checkpoints carry merged weights in HF names, the adapter saves in peft's format."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.train_engine import toy_batch
from roll_engines.infer.hf import HFInferEngine
from roll_engines.train.hf import HFTrainEngine

pytest.importorskip("peft")
LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return resolve_model_path("builtin:tiny")


def _optimizer_bytes(engine: HFTrainEngine) -> int:
    return sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values())


def _trained(path: str, **kw) -> HFTrainEngine:
    eng = HFTrainEngine(path, lr=1e-2, micro_batch_size=6, **kw)
    for _ in range(3):
        eng.train_step(toy_batch(path), PolicyObjective())
    return eng


def test_only_adapters_train_with_far_less_optimizer_state(path: str) -> None:
    full, lora = _trained(path), _trained(path, **LORA)
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert _optimizer_bytes(lora) < 0.25 * _optimizer_bytes(full)  # measured: ~12% on the tiny model


def test_reference_is_the_base_with_adapters_disabled(path: str) -> None:
    batch = toy_batch(path)
    base = HFTrainEngine(path, role="reference").compute_logprobs(batch)["logprobs"]
    lora = _trained(path, **LORA)
    policy = lora.compute_logprobs(batch)["logprobs"]
    reference = lora.compute_logprobs(batch, base=True)["logprobs"]
    torch.testing.assert_close(reference, base)  # no second copy of the model, same numbers
    assert (policy - reference).abs().max() > 1e-3  # the adapters did learn something


def test_sync_sends_merged_weights_an_inference_engine_reproduces(path: str) -> None:
    batch = toy_batch(path)
    lora = _trained(path, **LORA)
    names = [k for k, _ in lora.iter_weights()]
    hf_names = [k for k, _ in HFTrainEngine(path).iter_weights()]
    assert names == hf_names  # the base model's names, no peft prefixes
    changed = [k for k, _ in lora.iter_weights(changed_only=True)]
    assert changed and set(changed) < set(names) and all("proj" in k for k in changed)  # only adapted layers
    infer = HFInferEngine(path)
    infer.load_weights(dict(lora.iter_weights()))
    engine_view = HFTrainEngine(path, role="reference")
    engine_view.load_weights(dict(infer.model.state_dict()))
    torch.testing.assert_close(
        engine_view.compute_logprobs(batch)["logprobs"], lora.compute_logprobs(batch)["logprobs"], atol=1e-5, rtol=1e-5
    )


def test_checkpoint_has_merged_model_and_peft_adapter(path: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = toy_batch(path)
    lora = _trained(path, **LORA)
    lora.save(tmp_path / "ckpt", path)
    expected = lora.compute_logprobs(batch)["logprobs"]
    merged = HFTrainEngine(str(tmp_path / "ckpt" / "model"), role="reference")
    torch.testing.assert_close(merged.compute_logprobs(batch)["logprobs"], expected, atol=1e-5, rtol=1e-5)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):  # peft 0.21 vs transformers 5
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(path), tmp_path / "ckpt" / "adapter"
        )
    assert sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n) > 0
    fresh = HFTrainEngine(path, lr=1e-2, micro_batch_size=6, **LORA)
    fresh.load(tmp_path / "ckpt")
    torch.testing.assert_close(fresh.compute_logprobs(batch)["logprobs"], expected)
    lora.train_step(batch, PolicyObjective())
    fresh.train_step(batch, PolicyObjective())  # optimizer state came back: the next step is identical
    torch.testing.assert_close(fresh.compute_logprobs(batch)["logprobs"], lora.compute_logprobs(batch)["logprobs"])


def test_lora_is_for_the_policy(path: str) -> None:
    with pytest.raises(ValueError, match="LoRA trains the policy only"):
        HFTrainEngine(path, role="critic", **LORA)


def test_changed_only_sync_sends_whole_modules_of_the_adapted_layers(path: str) -> None:
    """Adapters on q_proj and v_proj only: a changed-only sync carries every parameter of those attention modules
    (k_proj and o_proj too: an engine loading q|k|v as one layer needs all of it) and nothing of the MLPs; a full
    model with a frozen k_proj does the same."""
    lora = HFTrainEngine(path, lora_target_modules=["q_proj", "v_proj"], **LORA)
    changed = {k for k, _ in lora.iter_weights(changed_only=True)}
    attention = {k for k, _ in HFTrainEngine(path).iter_weights() if ".self_attn." in k}
    assert changed == attention and not any(".mlp." in k for k in changed)
    full = HFTrainEngine(path)
    for name, p in full.model.named_parameters():
        p.requires_grad_(name.endswith("q_proj.weight"))
    assert {k for k, _ in full.iter_weights(changed_only=True)} == attention


def test_an_adapter_on_a_tied_head_is_refused(path: str, tmp_path: Path) -> None:
    """With tied embeddings the head's weight is the embedding's: its adapter would be left out of every sync and
    checkpoint (the shared tensor goes once, under the embedding's name): refused when the engine is built."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from roll_core.errors import ConfigError

    cfg = AutoConfig.from_pretrained(path)
    cfg.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp_path)
    for targets in (["q_proj", "lm_head"], ["embed_tokens"]):
        with pytest.raises(ConfigError, match=r"tied to .*leave the head and embeddings out"):
            HFTrainEngine(str(tmp_path), lora_target_modules=targets, **LORA)
    HFTrainEngine(str(tmp_path), lora_target_modules=["q_proj", "v_proj"], **LORA)  # the rest is fine
    HFTrainEngine(path, lora_target_modules=["q_proj", "lm_head"], **LORA)  # untied: the head has its own weight


def test_a_target_that_matches_no_layer_is_refused(path: str) -> None:
    """peft refuses a target list only when it matches nothing: a misspelt entry beside a correct one trained
    without the adapters it asked for (here: q_proj only). Every entry must adapt some layer."""
    from roll_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\['v_prj'\] match no layer"):
        HFTrainEngine(path, lora_target_modules=["q_proj", "v_prj"], **LORA)
    adapted = HFTrainEngine(path, lora_target_modules=["q_proj", "self_attn.v_proj"], **LORA).model
    assert {n.rsplit(".", 1)[-1] for n in adapted.targeted_module_names} == {"q_proj", "v_proj"}


def test_an_adapter_on_an_untied_embedding_syncs_and_saves_merged(path: str, tmp_path: Path) -> None:
    """peft adapts an (untied) embedding with lora_embedding_A/B, not lora_A/B: merging its weight raised KeyError
    at the first weight sync or save, after training had started. The merged weights are peft's own merge."""
    import copy

    batch = toy_batch(path)
    lora = _trained(path, lora_target_modules=["embed_tokens", "q_proj"], **LORA)
    expected = copy.deepcopy(lora.model).merge_and_unload().state_dict()
    merged = dict(lora.iter_weights())
    assert merged.keys() == expected.keys()
    for name, w in expected.items():
        torch.testing.assert_close(merged[name], w, msg=name)
    changed = {k for k, _ in lora.iter_weights(changed_only=True)}
    assert "model.embed_tokens.weight" in changed
    assert not torch.equal(
        merged["model.embed_tokens.weight"], HFTrainEngine(path).get_weights()["model.embed_tokens.weight"]
    )  # the embedding's adapter trained and is in the sync
    lora.save(tmp_path / "ckpt", path)
    view = HFTrainEngine(str(tmp_path / "ckpt" / "model"), role="reference")
    want = lora.compute_logprobs(batch)["logprobs"]
    torch.testing.assert_close(view.compute_logprobs(batch)["logprobs"], want, atol=1e-5, rtol=1e-5)
    fresh = HFTrainEngine(path, lora_target_modules=["embed_tokens", "q_proj"], **LORA)
    fresh.load(tmp_path / "ckpt")
    torch.testing.assert_close(fresh.compute_logprobs(batch)["logprobs"], want)


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_bf16_base_stays_bf16_and_the_adapters_train_in_fp32(path: str, kind: str) -> None:
    """model.dtype=bfloat16 with LoRA: the frozen base is held in bf16 (it was loaded as fp32 masters, twice the
    memory, though nothing updates it), the adapters and AdamW's state in fp32 (param_dtype); the base with adapters
    off scores as the bf16 reference engine; merged weights are the base's dtype, summed in fp32 and rounded once."""
    import torch.distributed as dist

    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    kw = dict(dtype="bfloat16", lr=1e-2, micro_batch_size=6, **LORA)
    try:
        lora = FSDP2TrainEngine.conformance_engine(path, **kw) if kind == "fsdp2" else HFTrainEngine(path, **kw)
        local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in lora.model.named_parameters()}
        base = [p for n, p in local.items() if ".lora_" not in n]
        adapters = [p for n, p in local.items() if ".lora_" in n]
        assert base and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base)
        assert adapters and all(p.dtype == torch.float32 and p.requires_grad for p in adapters)
        fp32_masters = HFTrainEngine(path, dtype="bfloat16", lr=1e-2)  # full training: fp32 masters, by design
        masters = sum(p.numel() * p.element_size() for p in fp32_masters.model.parameters())
        assert sum(p.numel() * p.element_size() for p in base) * lora.dp_size == masters // 2
        batch = toy_batch(path)
        lora.train_step(batch, PolicyObjective())
        moments = [t for s in lora.optimizer.state.values() for k, t in s.items() if k != "step"]
        assert moments and all(t.dtype == torch.float32 for t in moments)
        # The base, held wholly in bf16 (no master copy), is a pure bf16 reference (a standalone reference of an
        # fp32-master run keeps norms and embeddings in fp32 instead: roll_engines.train._precision).
        pure = HFTrainEngine(path, role="reference", dtype="bfloat16", param_dtype="bfloat16")
        reference = pure.compute_logprobs(batch)["logprobs"]
        torch.testing.assert_close(lora.compute_logprobs(batch, base=True)["logprobs"], reference)
        merged = dict(lora.iter_weights())
        assert all(w.dtype == torch.bfloat16 for w in merged.values())
        if kind == "hf":
            q = lora.model.base_model.model.model.layers[0].self_attn.q_proj
            delta = (q.lora_B["default"].weight @ q.lora_A["default"].weight).detach() * q.scaling["default"]
            want = (q.base_layer.weight.float() + delta).to(torch.bfloat16)
            assert float(delta.abs().max()) > 0  # the adapter trained
            assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], want)
    finally:
        if kind == "fsdp2" and dist.is_initialized():
            dist.destroy_process_group()


def test_only_the_writing_rank_keeps_host_copies_of_the_merged_model(
    path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded engine's save walks the merged weights on every rank (each full tensor is a collective gather),
    but only rank 0 writes: the other ranks kept a host copy of the whole merged model too (ranks x model size of
    host memory at every save of a multi-GPU LoRA run)."""
    from roll_engines.train._lora import save_lora

    eng = HFTrainEngine(path, lr=1e-2, **LORA)
    names = [k for k, _ in eng.iter_weights()]
    walked: list[str] = []

    def weights():
        for k, v in eng.iter_weights():
            walked.append(k)
            yield k, v

    copies: list[str] = []
    to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if kwargs.get("copy") and out.device.type == "cpu":
            copies.append("copy")
        return out

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    save_lora(eng.model, weights(), eng._full_tensor, False, tmp_path / "other-rank")
    assert walked == names  # every collective ran
    assert copies == [] and not (tmp_path / "other-rank").exists()
    save_lora(eng.model, weights(), eng._full_tensor, True, tmp_path / "writer")
    assert len(copies) == len(names) and (tmp_path / "writer" / "model" / "model.safetensors").is_file()
