"""LoRA edge cases of the transformers-based engines (roll_engines.train._lora): a resume refuses an adapter saved
with another rank or alpha (its A and B would compute another policy under this run's alpha / r), and an adapter
on a convolution (a target list reaching a vision tower's patch embedding) merges as peft merges it."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.train_engine import toy_batch
from roll_engines.train.hf import HFTrainEngine

pytest.importorskip("peft")


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))


def test_a_resume_with_another_lora_alpha_or_rank_is_refused(tmp_path: Path) -> None:
    path = resolve_model_path("builtin:tiny")
    eng = HFTrainEngine(path, lr=1e-2, micro_batch_size=6, lora_rank=4, lora_alpha=8.0)
    eng.train_step(toy_batch(path), PolicyObjective())
    eng.save(tmp_path / "ckpt", path)
    # alpha 16 loaded the saved A and B silently: log-probs off the saved policy's by up to 0.34
    with pytest.raises(ValueError, match=r"lora_alpha \(saved 8.0, this run 16.0\)"):
        HFTrainEngine(path, lr=1e-2, lora_rank=4, lora_alpha=16.0).load(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"differs from this run's in r \(saved 4, this run 8\)"):
        HFTrainEngine(path, lr=1e-2, lora_rank=8, lora_alpha=8.0).load(tmp_path / "ckpt")
    same = HFTrainEngine(path, lr=1e-2, micro_batch_size=6, lora_rank=4, lora_alpha=8)  # 8 == 8.0
    same.load(tmp_path / "ckpt")
    batch = toy_batch(path)
    torch.testing.assert_close(same.compute_logprobs(batch)["logprobs"], eng.compute_logprobs(batch)["logprobs"])


def test_an_adapter_file_missing_tensors_is_refused(tmp_path: Path) -> None:
    """A partial adapter_model.safetensors (a copy cut short, a hand-edited file) loaded silently: the adapters it
    lacked kept this run's fresh initialisation, a policy that was never the saved one."""
    from safetensors.torch import load_file, save_file

    path = resolve_model_path("builtin:tiny")
    eng = HFTrainEngine(path, lr=1e-2, micro_batch_size=6, lora_rank=4, lora_alpha=8.0)
    eng.train_step(toy_batch(path), PolicyObjective())
    eng.save(tmp_path / "ckpt", path)
    file = tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors"
    state = load_file(str(file))
    dropped = sorted(state)[0]
    del state[dropped]
    save_file(state, str(file))
    with pytest.raises(RuntimeError, match=r"adapter checkpoint mismatch: missing \['"):
        HFTrainEngine(path, lr=1e-2, lora_rank=4, lora_alpha=8.0).load(tmp_path / "ckpt")


def test_an_adapter_on_a_convolution_merges_as_peft_does() -> None:
    """["proj"] on Qwen2.5-VL adapts the vision tower's patch embedding, a Conv3d: the merge raised RuntimeError
    (`b @ a` on 5-D kernels) at the first weight sync after training had started."""
    path = resolve_model_path("builtin:tiny-qwen2.5-vl")
    eng = HFTrainEngine(path, lora_rank=4, lora_alpha=8.0, lora_target_modules=["proj"])
    assert any(n.endswith("patch_embed.proj") for n in eng.model.targeted_module_names)
    torch.manual_seed(1)
    with torch.no_grad():  # a trained adapter: B no longer zero
        for n, p in eng.model.named_parameters():
            if ".lora_B." in n:
                p.normal_()
    merged = dict(eng.iter_weights())
    expected = copy.deepcopy(eng.model).merge_and_unload().state_dict()
    assert set(merged) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(merged[k], v, atol=1e-5, rtol=1e-5, msg=k)
    conv = "model.visual.patch_embed.proj.weight"
    assert (merged[conv] - eng.model.get_base_model().model.visual.patch_embed.proj.base_layer.weight).abs().max() > 0.1
    with pytest.raises(ValueError, match="vision side"):  # vLLM serves the language model's adapters only
        dict(eng.iter_adapter())


def test_adapter_sync_refuses_adapters_on_the_vision_tower() -> None:
    """A target list (not "all-linear") reaches a vision-language model's vision tower too: Qwen2.5-VL's MLP names
    adapt `model.visual.blocks.*.mlp.*`. vLLM serves LoRA on the language model only (its tower LoRA is off) and
    dropped those adapters silently under lora_sync=adapter: its rollouts came from another policy than the
    trainer's. Refused, naming them; the language model's adapters alone are sent."""
    path = resolve_model_path("builtin:tiny-qwen2.5-vl")
    eng = HFTrainEngine(path, lora_rank=4, lora_alpha=8.0, lora_target_modules=["gate_proj", "up_proj", "down_proj"])
    assert any(".visual." in n for n in eng.model.targeted_module_names)
    with pytest.raises(ValueError, match=r"adapted layers are on the vision side \(.*visual.*lora_sync=merged"):
        dict(eng.iter_adapter())
    text = HFTrainEngine(path, lora_rank=4, lora_alpha=8.0, lora_target_modules="all-linear")
    sent = dict(text.iter_adapter())
    assert sent and not any(".visual." in k for k in sent)
