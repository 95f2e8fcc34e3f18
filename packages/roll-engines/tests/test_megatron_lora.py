"""LoRA on the `megatron` engine (TP=PP=1 in-process over gloo): the adapted model, its gradients and its exported
peft adapter equal peft's LoRA on the HF model; only adapters train; the base is the reference; checkpoints resume.
TP=2 / PP=2 layouts run on Ray in tests/e2e/test_megatron_ray.py."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("megatron_process_group")

LORA = {"lora_rank": 4, "lora_alpha": 8.0}
# Every decoder projection and the output layer (peft's "all-linear" leaves lm_head out).
WITH_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from roll_core.models import resolve_model_path

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return resolve_model_path("builtin:tiny")


def _megatron(path: str, distributed: bool = False, **kw):
    from roll_engines.train.megatron import MegatronTrainEngine

    common = {"dist_backend": "gloo", "micro_batch_size": 3, "lr": 1e-2, "use_distributed_optimizer": distributed}
    return MegatronTrainEngine(path, **{**common, **kw})


def _randomise_adapters(engine, seed: int = 0) -> None:
    """Non-zero A and B (B starts at zero, which hides a wrong A gradient or a wrong B layout)."""
    from roll_engines.train.megatron._lora import wrappers

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in wrappers(engine.model):
            for p in (m.lora_a, m.lora_b):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _hf_lora(path: str, adapter: Path, targets: list[str] | str = "all-linear"):
    from roll_engines.train._lora import load_adapter
    from roll_engines.train.hf import HFTrainEngine

    hf = HFTrainEngine(path, lr=1e-2, micro_batch_size=3, lora_target_modules=targets, **LORA)
    load_adapter(hf.model, adapter)
    return hf


def _optimizer_elements(engine) -> int:
    from roll_engines.train.megatron._checkpoint import parts

    return sum(t.numel() for opt in parts(engine.optimizer) for s in opt.optimizer.state.values() for t in s.values())


@pytest.mark.parametrize("targets", ["all-linear", WITH_HEAD], ids=["all-linear", "with-lm_head"])
def test_adapted_model_gradients_and_adapter_equal_peft_on_hf(path: str, tmp_path: Path, targets) -> None:
    """Log-probs, base log-probs and gradients equal peft's on the HF model with the exported adapter loaded; the
    merged `model/` equals peft's merge. A fused q/k/v (gate/up) layer shares one A, so its gradient is the sum of
    peft's per-projection A gradients (all equal A here). lm_head's B covers Megatron's padded vocabulary."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.megatron._lora import fused_gradients

    batch, objective = toy_batch(path), PolicyObjective(agg="token-mean")
    mega = _megatron(path, lora_target_modules=targets, **LORA)
    _randomise_adapters(mega)
    mega.save(tmp_path / "ckpt", path)
    hf = _hf_lora(path, tmp_path / "ckpt" / "adapter", targets)
    mask = batch["response_mask"].bool()
    for base in (False, True):
        got, want = mega.compute_logprobs(batch, base=base), hf.compute_logprobs(batch, base=base)
        torch.testing.assert_close(got["logprobs"][mask], want["logprobs"][mask], atol=1e-5, rtol=1e-5)
    adapted = mega.compute_logprobs(batch)["logprobs"][mask]
    base_lp = mega.compute_logprobs(batch, base=True)["logprobs"][mask]
    assert (adapted - base_lp).abs().max() > 1e-2  # the adapters do act

    grads = mega.compute_gradients(batch, objective)
    hf_grads = fused_gradients(
        {k.replace(".default", ""): v for k, v in hf.compute_gradients(batch, objective).items()}
    )
    projections = 7 * 2 + (targets == WITH_HEAD)  # 7 in each of 2 layers (and lm_head)
    assert set(grads) == set(hf_grads) and len(grads) == 2 * projections  # A and B of each
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(g, hf_grads[name], atol=1e-6, rtol=1e-4, msg=name)

    with warnings.catch_warnings():  # peft 0.21 still asks transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), tmp_path / "ckpt" / "adapter")
    merged = merged.merge_and_unload().state_dict()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model").state_dict()
    for name, w in mega.get_weights().items():
        torch.testing.assert_close(w, merged[name], atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(saved[name], w, msg=name)


def test_only_adapters_train_with_far_less_optimizer_state(path: str) -> None:
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch

    batch, objective = toy_batch(path), PolicyObjective()
    full, lora = _megatron(path), _megatron(path, **LORA)
    before = lora.get_weights()
    base_before = lora.compute_logprobs(batch, base=True)["logprobs"]
    for engine in (full, lora):
        metrics = engine.train_step(batch, objective)
        assert metrics["optimizer_steps"] == 1 and metrics["grad_norm"] > 0
    assert all(n.endswith(("lora_a", "lora_b")) for n, p in lora.model.named_parameters() if p.requires_grad)
    assert _optimizer_elements(lora) < 0.25 * _optimizer_elements(full)  # measured: ~6% on the tiny model
    after = lora.get_weights()
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    adapted = {n for n, _ in lora.iter_weights(changed_only=True)}
    assert changed == adapted and len(adapted) == 7 * 2  # the merged projections, nothing else
    torch.testing.assert_close(lora.compute_logprobs(batch, base=True)["logprobs"], base_before)
    assert not torch.equal(lora.compute_logprobs(batch)["logprobs"], base_before)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed-optimizer"])
def test_checkpoint_resumes_adapter_and_optimizer(path: str, tmp_path: Path, distributed: bool) -> None:
    """Step, save, step: a fresh engine that loads the checkpoint takes the same second step (Adam's moments and
    step count restored with the adapter; a fresh optimizer's second step differs by up to lr)."""
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch

    batch, objective = toy_batch(path), PolicyObjective()
    first = _megatron(path, distributed, **LORA)
    first.train_step(batch, objective)
    first.save(tmp_path / "ckpt", path)
    first.train_step(batch, objective)
    resumed = _megatron(path, distributed, seed=1, **LORA)  # another initial adapter: the load must replace it
    resumed.load(tmp_path / "ckpt")
    resumed.train_step(batch, objective)
    torch.testing.assert_close(
        resumed.compute_logprobs(batch)["logprobs"], first.compute_logprobs(batch)["logprobs"], atol=1e-5, rtol=0
    )
    expected = first.get_weights()
    for name, w in resumed.get_weights().items():
        torch.testing.assert_close(w, expected[name], atol=1e-5, rtol=0, msg=name)


def test_lora_config_errors(path: str, tmp_path: Path) -> None:
    from roll_engines.config import MegatronTrainEngineConfig
    from roll_engines.train.megatron._lora import resolve_targets

    assert resolve_targets(["o_proj", "down_proj"]) == ["linear_proj", "linear_fc2"]
    assert resolve_targets("all-linear") == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert resolve_targets(["lm_head", "o_proj"]) == ["linear_proj", "output_layer"]
    assert resolve_targets(["q_proj", "k_proj", "v_proj", "linear_fc1"]) == ["linear_qkv", "linear_fc1"]
    with pytest.raises(ValueError, match="shares one LoRA A: target all of"):
        MegatronTrainEngineConfig(lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="not adaptable"):
        MegatronTrainEngineConfig(lora_rank=4, lora_target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match="without dropout"):
        MegatronTrainEngineConfig(lora_rank=4, lora_dropout=0.1)
    engine = _megatron(path, **LORA)
    engine.save(tmp_path / "ckpt", path)
    other = _megatron(path, lora_rank=8, lora_alpha=8.0)
    with pytest.raises(ValueError, match=r"adapter r=4, lora_alpha=8\.0; this run has lora_rank=8"):
        other.load(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="this engine has none"):
        _megatron(path).compute_logprobs({}, base=True)


def test_lm_head_of_a_tied_model_is_refused(path: str, tmp_path: Path) -> None:
    """A merged lm_head of a model whose lm_head is its input embedding would change the embeddings too."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(path)
    cfg.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp_path / "tied")
    with pytest.raises(ValueError, match="ties to its input embeddings"):
        _megatron(str(tmp_path / "tied"), lora_target_modules=WITH_HEAD, **LORA)
    _megatron(str(tmp_path / "tied"), **LORA)  # the decoder's projections alone are fine


def test_an_adapter_this_run_cannot_carry_whole_is_refused(path: str, tmp_path: Path) -> None:
    """An all-linear adapter loaded with fewer targets lost its MLP adapters silently (the loaded policy was not
    the saved one; a resume then failed only on the optimizer state, with a KeyError); an adapter whose peft
    options change its output (rsLoRA's alpha / sqrt(r)) loaded as alpha / r. Both are refused, and the refused
    load leaves the engine's adapters as they were."""
    import json

    from roll_engines.train.megatron._lora import load_adapter, wrappers

    saved = _megatron(path, **LORA)
    _randomise_adapters(saved)
    saved.save(tmp_path / "ckpt", path)
    fewer = _megatron(path, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], **LORA)
    before = {n: m.lora_a.detach().clone() for n, m in wrappers(fewer.model)}
    with pytest.raises(ValueError, match=r"adapts 12 tensors this run does not target .*mlp\.down_proj"):
        load_adapter(fewer.model, fewer.hf_config, tmp_path / "ckpt" / "adapter", 4, 8.0)
    assert all(torch.equal(m.lora_a, before[n]) for n, m in wrappers(fewer.model))
    config = tmp_path / "ckpt" / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_rslora": True}))
    with pytest.raises(ValueError, match=r"uses \{'use_rslora': True\}"):
        load_adapter(saved.model, saved.hf_config, tmp_path / "ckpt" / "adapter", 4, 8.0)
