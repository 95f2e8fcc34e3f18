"""Small real models of the transformers families engines map by hand (Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE), built from a
config with the builtin tiny tokenizer and saved as an HF folder, and the check that an engine maps one exactly:
for conversion and parallelism tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

KINDS = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")


def tiny_model(kind: str, folder: str | Path, norm_topk_prob: bool = True) -> str:
    """A 2-layer `kind` model saved in `folder` (returned as a str). The weights a wrong mapping would drop or
    misplace are made to matter: qwen2's q/k/v biases and qwen3's q/k norm weights are randomised; qwen3_moe
    and qwen2_moe (4 experts, top-2, `norm_topk_prob`) get router weights large enough that routing is decided by
    clear margins (a near tie could route differently under float noise); qwen2_moe's shared expert gate is
    spread so that its sigmoid differs from token to token (a dropped or constant gate shows)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    from roll_core.models import resolve_model_path

    if kind not in KINDS:
        raise ValueError(f"tiny_model builds {KINDS}, not {kind!r}")
    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))
    common = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "pad_token_id": tok.pad_token_id,
    }
    if kind == "qwen2":
        cfg = Qwen2Config(**common)
    elif kind == "qwen3":
        cfg = Qwen3Config(head_dim=16, **common)
    else:
        moe = {
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": norm_topk_prob,
        }
        if kind == "qwen3_moe":
            cfg = Qwen3MoeConfig(head_dim=16, **moe, **common)
        else:
            cfg = Qwen2MoeConfig(shared_expert_intermediate_size=48, **moe, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
                p.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def assert_matches_transformers(engine: Any, path: str, state: dict[str, torch.Tensor]) -> None:
    """A training engine built from `path` exports exactly `state` (name -> tensor, in the names its weights
    sync under) and gives transformers' teacher-forced log-probs of `toy_batch` at temperature 0.7 (within 1e-5)."""
    import pytest
    from transformers import AutoTokenizer

    from roll_core.testing import teacher_forced_logprobs
    from roll_core.testing.batches import PROMPTS, toy_batch

    exported = dict(engine.iter_weights())
    assert exported.keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(exported[name], value, atol=0, rtol=0, msg=name)
    batch, tok = toy_batch(path), AutoTokenizer.from_pretrained(path)
    out = engine.compute_logprobs(batch, temperature=0.7)
    mask = batch["response_mask"]
    for i in range(len(mask)):
        n = int(mask[i].sum())
        tokens = batch["responses"][i, :n].tolist()
        ref = teacher_forced_logprobs(path, list(tok(PROMPTS[i // 2])["input_ids"]), tokens, 0.7)
        assert out["logprobs"][i, :n].tolist() == pytest.approx(ref, abs=1e-5), (path, i)


def tiny_critic(folder: str | Path) -> str:
    """A qwen2 `tiny_model` as a critic checkpoint: transformers' token classifier with one label (what the hf
    critic trains and saves), its value head spread (N(0, 0.5), bias 0.3) so that values differ clearly by token;
    saved in `folder/critic` (returned as a str)."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    folder = Path(folder)
    lm = tiny_model("qwen2", folder / "lm")
    torch.manual_seed(5)
    critic = AutoModelForTokenClassification.from_pretrained(lm, num_labels=1)
    with torch.no_grad():
        critic.score.weight.normal_(0.0, 0.5)
        critic.score.bias.fill_(0.3)
    critic.save_pretrained(folder / "critic")
    AutoTokenizer.from_pretrained(lm).save_pretrained(folder / "critic")
    return str(folder / "critic")
