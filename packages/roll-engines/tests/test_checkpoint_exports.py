"""What a user takes away from a run: a checkpoint's `model/` folder is the trained model as its base shipped it.

- config.json is the base model's (the trained weights aside): the engines turn the KV cache off for their training
  forwards, and every `hf`/`fsdp2` checkpoint (full, LoRA merged, critic) said `use_cache: false`, so a plain
  forward on the exported folder returned no cache; the engine itself keeps training without one after a save.
- a vision-language model whose processor template (`chat_template.json`, the hub's legacy layout) differs from its
  tokenizer's (`tokenizer_config.json`) is exported with both where they were: transformers 5 saved the tokenizer's
  as `chat_template.jinja`, which the tokenizer (and then roll) read first, and `roll-eval` on the checkpoint
  rendered prompts with the tokenizer's template instead of the one the run trained on.

(Weights, log-probs against plain transformers, tokenizer, generation config, ties, peft adapters and critics of
every engine are checked by test_hf_engines, test_fsdp2_checkpoints, test_lora, test_megatron_* .)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_core.testing.models import tiny_model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"), family="qwen2.5")


@pytest.fixture
def _release_distributed():
    """The fsdp2 engine's one-rank gloo group of this process: leave none behind."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


@pytest.mark.usefixtures("_release_distributed")
def test_exported_config_is_the_base_models_and_a_plain_forward_returns_a_cache(qwen2: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from roll_engines.train.fsdp2 import FSDP2TrainEngine
    from roll_engines.train.hf import HFTrainEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    base = _config(qwen2)
    assert base["use_cache"] is True
    batch = toy_batch(qwen2)
    engines = {
        "hf": lambda: HFTrainEngine(qwen2, lr=1e-2),
        "lora": lambda: HFTrainEngine(qwen2, lr=1e-2, lora_rank=4, lora_alpha=8.0),
        "critic": lambda: HFTrainEngine(qwen2, role="critic", lr=1e-2),
        "fsdp2": lambda: FSDP2TrainEngine(qwen2, lr=1e-2, dist_backend="gloo"),
    }
    for name, build in engines.items():
        engine = build()
        if name != "critic":
            engine.train_step(batch, PolicyObjective())
        before = engine.compute_values(batch) if name == "critic" else engine.compute_logprobs(batch)
        engine.save(tmp_path / name, qwen2)
        saved = _config(tmp_path / name / "model")
        assert saved["use_cache"] is True, name
        if name != "critic":  # (the critic's config is a token classifier's: architectures, id2label)
            assert {k: v for k, v in saved.items() if base.get(k) != v} == {}, name
        # The engine trains on without a cache, and its outputs are untouched by the save.
        assert engine.model.config.use_cache is False, name
        after = engine.compute_values(batch) if name == "critic" else engine.compute_logprobs(batch)
        for key, value in before.items():
            torch.testing.assert_close(after[key], value, atol=0, rtol=0, msg=name)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "model").eval()
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]))
    assert out.past_key_values is not None  # the base's forward returns one; the checkpoint's returned None


def test_a_vision_checkpoint_keeps_the_processor_template_the_run_rendered_with(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from roll_core.multimodal.processor import VisionProcessor
    from roll_core.multimodal.tiny import build_tiny_qwen_vl
    from roll_engines.train.hf import HFTrainEngine

    base = tmp_path / "vl"
    build_tiny_qwen_vl(base)
    # The hub's legacy layout: the processor's template in chat_template.json, the tokenizer's own (another one)
    # in tokenizer_config.json, no chat_template.jinja.
    processor_template = (base / "chat_template.jinja").read_text()
    (base / "chat_template.jinja").unlink()
    (base / "chat_template.json").write_text(json.dumps({"chat_template": processor_template}))
    tokenizer_template = "{% for m in messages %}TOKENIZER {{ m['content'] }}{% endfor %}"
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": tokenizer_template}))
    run = VisionProcessor(base)
    assert run.chat_template == processor_template
    assert AutoTokenizer.from_pretrained(base).chat_template == tokenizer_template

    HFTrainEngine(str(base), lr=1e-2).save(tmp_path / "ckpt", str(base))
    folder = tmp_path / "ckpt" / "model"
    # roll-eval on the checkpoint renders the run's prompts (it rendered them with the tokenizer's template).
    assert VisionProcessor(folder).chat_template == processor_template
    assert json.loads((folder / "chat_template.json").read_text())["chat_template"] == processor_template
    assert AutoTokenizer.from_pretrained(folder).chat_template == tokenizer_template  # the tokenizer's kept too
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = run.tokenizer.apply_chat_template(messages, chat_template=run.chat_template, tokenize=False)
    exported = VisionProcessor(folder)
    assert exported.tokenizer.apply_chat_template(messages, chat_template=exported.chat_template, tokenize=False) == (
        rendered
    )
