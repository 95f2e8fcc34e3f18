"""Model presets through the `vllm` engine (vLLM's own venv, CPU build; skipped in the main venv): one engine start
per architecture that vLLM's other tests do not run, on a tiny random model with the family's template and special
tokens (roll_core.testing.models): Gemma3's text model (sliding-window layers, a stop token that is not the
tokenizer's eos) and Qwen3-MoE (q/k norms, routed experts). Llama is builtin:tiny-wide's architecture
(test_vllm.py); the Qwen2/Qwen3 dense layers are Qwen3-MoE's attention without the experts, not started again
for CI time. Each: the preset's prompt, greedy decoding stops at the preset's stop token, and log-probs sampled
at the preset's temperature equal transformers' (1e-4, fp32, the conformance suite's vLLM tolerance)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")

STOP = {"gemma3": "<end_of_turn>", "qwen3_moe": "<|endoftext|>"}  # not the tokenizer's eos: only the preset stops it
ENGINE = {"max_model_len": 256, "kv_cache_gb": 1, "max_num_seqs": 8, "device": "cpu"}


def _preset(name: str):
    """conf/model/<name>.yaml as a typed ModelConfig (its `defaults` list names the schema this builds directly)."""
    from omegaconf import OmegaConf

    import roll_core
    from roll_core.config.schema import ModelConfig

    node = OmegaConf.load(Path(roll_core.__file__).parent / "conf" / "model" / f"{name}.yaml")
    node.pop("defaults")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build's check; GPUs run the presets with real weights")
@pytest.mark.parametrize("preset", list(STOP))
def test_preset_on_vllm(preset: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from roll_core.config.generation import stop_token_ids
    from roll_core.interfaces import SamplingParams
    from roll_core.testing import teacher_forced_logprobs
    from roll_core.testing.models import PRESET_MODELS, emit_token_greedily, tiny_model
    from roll_engines.infer.vllm import VLLMInferEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    kind, family = PRESET_MODELS[preset]
    path = tiny_model(kind, tmp_path / kind, family=family, head_dim=32)  # vLLM's CPU attention: >= 32 per head
    model = _preset(preset)  # this venv has roll's code but not its entry points: no Hydra composition here
    tok = AutoTokenizer.from_pretrained(path)
    messages = [[{"role": "user", "content": q}] for q in ("What is 1+2?", "Say 7")]
    prompts = [
        list(tok.apply_chat_template(m, add_generation_prompt=True, return_dict=False, **model.chat_template_kwargs))
        for m in messages
    ]
    gen = model.generation
    params = SamplingParams(
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        stop_token_ids=stop_token_ids(tok, model.stop_tokens),
    )
    expected = emit_token_greedily(path, prompts[0], STOP[preset], stop_ids=(*params.stop_token_ids, tok.eos_token_id))

    engine = VLLMInferEngine(path, seed=0, max_new_tokens=24, **ENGINE)
    try:
        greedy = engine.generate(prompts[:1], params.replace(temperature=0, max_new_tokens=24))
        n = int(greedy.response_mask[0].sum())
        assert greedy.responses[0, :n].tolist() == expected and greedy.finish_reasons == ["stop"]
        sampled = engine.generate(prompts, params.replace(top_p=1.0, top_k=0, max_new_tokens=6, seed=3))
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        n = int(sampled.response_mask[i].sum())
        tokens = sampled.responses[i, :n].tolist()
        ref = teacher_forced_logprobs(path, prompt, tokens, params.temperature)
        assert sampled.logprobs[i, :n].tolist() == pytest.approx(ref, abs=1e-4), (preset, i)
