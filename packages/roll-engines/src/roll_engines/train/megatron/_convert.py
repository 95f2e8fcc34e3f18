"""Hugging Face decoder <-> Megatron-Core GPTModel: config, model construction and weights, with TP/PP sharding.

Families: Llama, Qwen2 (bias on q/k/v), Qwen3 (q/k RMSNorm), Qwen3-MoE and Qwen2-MoE (routed plus gated shared
experts); rotary embeddings plain or scaled (linear, llama3, yarn: _rope). Megatron's local layer spec (no Transformer
Engine) names a stage's parameters (layer indices local to the stage):

| Megatron (local spec) | HF | sharding |
|---|---|---|
| embedding.word_embeddings.weight | model.embed_tokens.weight | vocab rows (first stage) |
| decoder.layers.i.input_layernorm.weight | model.layers.i.input_layernorm.weight | replicated |
| decoder.layers.i.self_attention.linear_qkv.{weight,bias} | q_proj, k_proj, v_proj | rows, per KV group |
| decoder.layers.i.self_attention.{q,k}_layernorm.weight | self_attn.{q,k}_norm.weight (Qwen3) | replicated |
| decoder.layers.i.self_attention.linear_proj.weight | self_attn.o_proj.weight | columns |
| decoder.layers.i.pre_mlp_layernorm.weight | post_attention_layernorm.weight | replicated |
| decoder.layers.i.mlp.linear_fc1.weight | [gate_proj; up_proj] | rows, gate and up each |
| decoder.layers.i.mlp.linear_fc2.weight | mlp.down_proj.weight | columns |
| decoder.final_layernorm.weight | model.norm.weight | replicated (last stage) |
| output_layer.weight | lm_head.weight | vocab rows (last stage) |
| decoder.layers.i.mlp.router.weight | mlp.gate.weight (Qwen3-MoE) | replicated |
| decoder.layers.i.mlp.experts.local_experts.j.linear_fc{1,2}.weight | mlp.experts.{gate_up,down}_proj[e] | EP, TP |
| decoder.layers.i.mlp.shared_experts.linear_fc1.weight | [shared_expert.gate_proj; up_proj] (Qwen2-MoE) | as fc1 |
| decoder.layers.i.mlp.shared_experts.linear_fc2.weight | mlp.shared_expert.down_proj.weight | as fc2 |
| decoder.layers.i.mlp.shared_experts.gate_weight | mlp.shared_expert_gate.weight (1, H) | replicated |

Qwen3-MoE (every layer sparse) uses Megatron's MoE layer with its SequentialMLP experts: expert parallel rank p holds
experts p * E/ep ... (p + 1) * E/ep - 1 as local experts 0.. (under TP, which Megatron trains MoE with only under
sequence parallelism, each expert is split over TP like the dense MLP, and so is the shared expert). HF
checkpoints store each expert (`mlp.experts.e.{gate,up,down}_proj.weight`), transformers' model fuses them
(`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)): weights load from either and export fused, in the
model's own names. The router is Qwen3's: softmax, top-k, renormalised when `norm_topk_prob` (Megatron's top-k then
softmax), else not (Megatron's pre-softmax); no auxiliary loss (the RL objective alone is trained). Qwen2-MoE
routes the same way and adds, in every sparse layer, a shared expert that sees every token, scaled by
sigmoid(shared_expert_gate(x)): Megatron's SharedExpertMLP with `moe_shared_expert_gate` computes exactly that.

Sequence parallelism (`sequence_parallel`, TP > 1): Megatron keeps activations between its tensor-parallel regions
(norms, residuals, dropout) split along the sequence over the TP ranks; its torch norm refuses that, so the layer
spec here uses `RMSNorm`, torch's RMSNorm whose weight is marked `sequence_parallel` (each TP rank then sees other
tokens, and Megatron all-reduces marked gradients over TP). Sequences are padded to a multiple of TP by the engine.
Context parallelism swaps the spec's attention for roll's all-gather one (_context).

QKV is interleaved per KV group (the group's q heads, then its k head, then its v head); a TP rank holds a
contiguous block of groups, so the KV head count must be a multiple of TP. The vocabulary is padded with zero rows
to a multiple of TP; the padded logits are masked before any softmax. The embeddings (and lm_head) must have
`vocab_size` rows, and an untied config needs its lm_head in the checkpoint.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from roll_engines.train.megatron import _rope as R

# check_supported and SUPPORTED are re-exported: the engine calls C.check_supported before building anything
from roll_engines.train.megatron._supported import SUPPORTED, check_supported, is_moe  # noqa: F401

_EXPERT = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def is_expert(name: str) -> bool:
    """Whether a Megatron parameter is one of a MoE layer's routed experts' (`...local_experts.j....`)."""
    return _EXPERT.match(name) is not None


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def transformer_config(
    hf_config: Any,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    recompute: str | None,
    ep: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
) -> Any:
    """Megatron TransformerConfig of an HF decoder config, with every fused (CUDA-only) kernel off."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    kwargs: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2"
        or bool(getattr(hf_config, "attention_bias", False))
        or (hf_config.model_type == "qwen2_moe" and bool(hf_config.qkv_bias)),
        qk_layernorm=hf_config.model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        attention_softmax_in_fp32=True,
        attention_backend=AttnBackend.local,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel and tp > 1,  # nothing to split at TP=1
        variable_seq_lengths=True,  # the last micro-batch may hold fewer rows
        moe_token_dispatcher_type="alltoall",  # the default allgather refuses variable lengths
    )
    if is_moe(hf_config):
        kwargs.update(
            num_moe_experts=hf_config.num_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_router_pre_softmax=not hf_config.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            expert_model_parallel_size=ep,
        )
        if hf_config.model_type == "qwen2_moe":
            kwargs.update(
                moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
                moe_shared_expert_gate=True,
            )
    if recompute:
        kwargs.update(recompute_granularity=recompute)
        if recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    return R.configure(TransformerConfig(**kwargs), hf_config)


class RMSNorm(torch.nn.RMSNorm):
    """Megatron's local-spec norm (torch's RMSNorm) that also runs under sequence parallelism: its weight is marked
    `sequence_parallel`, so Megatron all-reduces its gradient over TP (each TP rank normalises other tokens). Its
    weight is in the model's dtype like every other parameter (Megatron's own torch norm stays fp32 and leaves the
    casting to Float16Module, which this engine does not use): a bf16 model is bf16 throughout, its fp32 masters
    in the optimizer."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def _layer_spec(config: Any) -> Any:
    """The local layer spec with `RMSNorm` for every norm, as block submodules (the block's final norm too), and
    under context parallelism roll's all-gather attention (roll_engines.train.megatron._context)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    replace: dict[type, type] = {WrappedTorchNorm: RMSNorm}
    if config.context_parallel_size > 1:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from roll_engines.train.megatron._context import ContextParallelAttention

        replace[DotProductAttention] = ContextParallelAttention

    def swap(spec: Any) -> Any:
        if isinstance(spec, type) and spec in replace:
            return replace[spec]
        if isinstance(spec, ModuleSpec):
            return dataclasses.replace(spec, submodules=swap(spec.submodules))
        if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
            return dataclasses.replace(spec, **{f.name: swap(getattr(spec, f.name)) for f in dataclasses.fields(spec)})
        return spec

    layer = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=config.qk_layernorm,
    )
    return TransformerBlockSubmodules(layer_specs=[swap(layer)] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def build_model(hf_config: Any, config: Any, critic: bool = False) -> Any:
    """This pipeline stage's GPTModel (vocab padded for TP; logits stay vocab-parallel)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if config.num_moe_experts:
        from megatron.core.transformer.moe import moe_utils

        # Megatron-Core 0.16 bug: without Transformer Engine, its router's gating function tests a
        # `te_general_gemm` that only the TE import defines (NameError on every MoE forward). None is what it
        # means by "absent".
        if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(config),
        vocab_size=padded_vocab(hf_config.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        # The critic's output layer is its own value head (_critic), never the embeddings.
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings) and not critic,
        parallel_output=True,
        **R.model_kwargs(hf_config),
    )
    return R.install(model, hf_config)


# ---- HF -> Megatron -----------------------------------------------------------------------------------------
def _dims(cfg: Any) -> tuple[int, int, int]:
    nq, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    return nq, ng, getattr(cfg, "head_dim", None) or cfg.hidden_size // nq


def qkv_to_mcore(q: Tensor, k: Tensor, v: Tensor, cfg: Any) -> Tensor:
    nq, ng, d = _dims(cfg)
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(ng, (nq // ng) * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1
    ).reshape(-1, *rest)


def qkv_to_hf(qkv: Tensor, cfg: Any) -> tuple[Tensor, Tensor, Tensor]:
    nq, ng, d = _dims(cfg)
    rest = qkv.shape[1:]
    q, k, v = torch.split(qkv.reshape(ng, (nq // ng + 2) * d, *rest), [(nq // ng) * d, d, d], dim=1)
    return q.reshape(nq * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def pad_rows(w: Tensor, n: int) -> Tensor:
    return w if w.shape[0] == n else torch.cat([w, w.new_zeros(n - w.shape[0], *w.shape[1:])])


def split_dim(name: str) -> int | None:
    """0: column/vocab parallel (rows split), 1: row parallel (columns split), None: replicated."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight")):
        return 0
    if name.endswith("output_layer.weight"):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def hf_to_mcore(hf: dict[str, Tensor], cfg: Any, vocab: int) -> dict[str, Any]:
    """Unsharded Megatron tensors (global layer indices); fc1 stays a (gate, up) pair until sharded. No
    `output_layer.weight` when the checkpoint has no lm_head and the config does not tie it to the embeddings
    (a critic's checkpoint: load_hf decides)."""
    embed = hf["model.embed_tokens.weight"]
    head = hf["lm_head.weight"] if "lm_head.weight" in hf else (embed if cfg.tie_word_embeddings else None)
    for name, t in (("model.embed_tokens.weight", embed), ("lm_head.weight", head)):
        # Zero rows padded onto a short matrix would be trained and exported as if they were the model's.
        if t is not None and t.shape[0] != cfg.vocab_size:
            raise ValueError(f"{name} has {t.shape[0]} rows; the config's vocab_size is {cfg.vocab_size}")
    out: dict[str, Any] = {
        "embedding.word_embeddings.weight": pad_rows(embed, vocab),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if head is not None:
        out["output_layer.weight"] = pad_rows(head, vocab)
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv_to_mcore(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], cfg
        )
        if a + "q_proj.bias" in hf:
            out[m + "self_attention.linear_qkv.bias"] = qkv_to_mcore(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], cfg
            )
        if a + "q_norm.weight" in hf:
            out[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        if is_moe(cfg):
            out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
            for e, (gate, up, down) in enumerate(_experts(hf, h + "mlp.experts.", cfg.num_experts)):
                out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (gate, up)
                out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down
            if h + "mlp.shared_expert_gate.weight" in hf:
                se = h + "mlp.shared_expert."
                fc1 = (hf[se + "gate_proj.weight"], hf[se + "up_proj.weight"])
                out[m + "mlp.shared_experts.linear_fc1.weight"] = fc1
                out[m + "mlp.shared_experts.linear_fc2.weight"] = hf[se + "down_proj.weight"]
                out[m + "mlp.shared_experts.gate_weight"] = hf[h + "mlp.shared_expert_gate.weight"]
            continue
        out[m + "mlp.linear_fc1.weight"] = (hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


def _experts(hf: dict[str, Tensor], prefix: str, n: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(gate, up, down) of each expert, from a checkpoint's per-expert tensors or the model's fused ones."""
    if prefix + "gate_up_proj" in hf:
        gate_up, down = hf[prefix + "gate_up_proj"], hf[prefix + "down_proj"]  # (E, 2I, H), (E, H, I)
        return [(*gate_up[e].chunk(2, 0), down[e]) for e in range(n)]
    return [tuple(hf[f"{prefix}{e}.{k}_proj.weight"] for k in ("gate", "up", "down")) for e in range(n)]  # type: ignore[misc]


def shard(
    full: dict[str, Any],
    tp_rank: int,
    tp: int,
    offset: int,
    layers: int,
    first: bool,
    last: bool,
    experts: range = range(0),
) -> dict:
    """One (TP rank, PP stage, EP rank)'s tensors with stage-local layer and expert indices (`experts`: the global
    indices of this EP rank's experts)."""
    out = {}
    for name, t in full.items():
        expert = _EXPERT.match(name)
        if expert:
            if int(expert.group(2)) not in experts:
                continue
            name = f"{expert.group(1)}{int(expert.group(2)) - experts.start}{expert.group(3)}"
        found = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if found:
            g = int(found.group(1))
            if not offset <= g < offset + layers:
                continue
            name_local = f"decoder.layers.{g - offset}.{found.group(2)}"
        elif (name.startswith("embedding.") and not first) or (
            name.startswith(("output_layer.", "decoder.final_layernorm")) and not last
        ):
            continue
        else:
            name_local = name
        if name.endswith("linear_fc1.weight"):
            gate, up = t
            out[name_local] = torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]])
        else:
            d = split_dim(name)
            out[name_local] = t if d is None else t.chunk(tp, d)[tp_rank]
    return out


def load_hf(
    model: Any, hf: dict[str, Tensor], cfg: Any, head: dict[str, Tensor] | None = None, write: bool = True
) -> dict[str, Tensor]:
    """Copy an HF state dict into this rank's stage (parallel_state tells TP rank and stage); `head`: a critic's
    value-head tensors (replicated), which replace the output layer. Names and shapes are checked whole before any
    tensor is copied (a refused load leaves the model as it was); `write=False` only checks, and returns this
    rank's tensors for `write_mapped` (a checkpoint load writes them once its optimizer state has been read)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tp = ps.get_tensor_model_parallel_world_size()
    read = _Reads(hf)
    full = hf_to_mcore(read, cfg, padded_vocab(cfg.vocab_size, tp))
    # the decoder's tensors (a critic's value head, `score.*`, comes in `head`)
    unread = sorted(k for k in set(hf) - read.keys_read if k.startswith("model."))
    if unread:  # a tensor the mapping does not carry would be dropped: untrained, missing from every export
        raise RuntimeError(
            f"the checkpoint holds {len(unread)} tensors roll's Megatron mapping does not carry ({unread[:4]}"
            f"{' ...' if len(unread) > 4 else ''}): train this model with train_engine=hf or fsdp2"
        )
    if cfg.tie_word_embeddings or head is not None:
        full.pop("output_layer.weight", None)
    elif "output_layer.weight" not in full:
        # transformers would start such an lm_head at random: the embeddings in its place are another model
        raise RuntimeError(
            "the checkpoint has no lm_head.weight and its config does not tie it to the embeddings "
            "(tie_word_embeddings=false): the output layer has no weights to load"
        )
    mine = shard(
        full,
        ps.get_tensor_model_parallel_rank(),
        tp,
        get_transformer_layer_offset(model.config),
        len(model.decoder.layers),
        model.pre_process,
        model.post_process,
        local_experts(cfg),
    )
    if head is not None and model.post_process:
        mine.update(head)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = sorted(set(own) - set(mine)), sorted(set(mine) - set(own))
    if missing or unexpected:
        raise RuntimeError(f"HF -> Megatron mapping mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    bad = next((k for k, v in mine.items() if own[k].shape != v.shape), None)
    if bad is not None:
        raise RuntimeError(f"{bad}: Megatron shape {tuple(own[bad].shape)} vs mapped {tuple(mine[bad].shape)}")
    if write:
        write_mapped(model, mine)
    return mine


def write_mapped(model: Any, mine: dict[str, Tensor]) -> None:
    """Copy `load_hf(..., write=False)`'s checked tensors into `model`."""
    own = model.state_dict()
    with torch.no_grad():
        for k, v in mine.items():
            own[k].copy_(v)


class _Reads(dict):
    """A state dict that remembers which of its tensors were read (load_hf's check that none is left out)."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        super().__init__(tensors)
        self.keys_read: set[str] = set()

    def __getitem__(self, key: str) -> Tensor:
        self.keys_read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            self.keys_read.add(key)
        return super().get(key, default)


def local_experts(cfg: Any) -> range:
    """Global indices of this expert-parallel rank's experts (empty for a dense model)."""
    from megatron.core import parallel_state as ps

    if not is_moe(cfg):
        return range(0)
    n = cfg.num_experts // ps.get_expert_model_parallel_world_size()
    return range(ps.get_expert_model_parallel_rank() * n, (ps.get_expert_model_parallel_rank() + 1) * n)


# ---- Megatron -> HF -----------------------------------------------------------------------------------------
def gather_tp(name: str, t: Tensor) -> Any:
    """All-gather a TP shard into the full tensor (fc1 as a (gate, up) pair). Collective over the TP group (the
    expert TP group for an expert's weights)."""
    from megatron.core import parallel_state as ps

    expert = _EXPERT.match(name) is not None
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    d = split_dim(name)
    parts = [t]
    if d is not None and tp > 1:
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=group)
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*[p.chunk(2, 0) for p in parts])
        return torch.cat(gates), torch.cat(ups)
    return parts[0] if len(parts) == 1 else torch.cat(parts, d)


def to_hf(name: str, t: Any, cfg: Any, offset: int) -> dict[str, Tensor]:
    """HF tensors of one gathered Megatron tensor (global layer index = local + offset; vocab padding dropped)."""
    v = cfg.vocab_size
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": t[:v]}
    if name == "output_layer.weight":
        return {} if cfg.tie_word_embeddings else {"lm_head.weight": t[:v]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": t}
    found = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not found:
        raise KeyError(f"no HF name for Megatron tensor {name!r}")
    h = f"model.layers.{int(found.group(1)) + offset}."
    rest = found.group(2)
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    if rest in simple:
        return {h + simple[rest]: t}
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        q, k, vv = qkv_to_hf(t, cfg)
        return {
            h + f"self_attn.q_proj.{kind}": q,
            h + f"self_attn.k_proj.{kind}": k,
            h + f"self_attn.v_proj.{kind}": vv,
        }
    if rest == "mlp.linear_fc1.weight":
        return {h + "mlp.gate_proj.weight": t[0], h + "mlp.up_proj.weight": t[1]}
    if rest == "mlp.router.weight":
        return {h + "mlp.gate.weight": t}
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return {h + "mlp.shared_expert.gate_proj.weight": t[0], h + "mlp.shared_expert.up_proj.weight": t[1]}
    if rest == "mlp.shared_experts.linear_fc2.weight":
        return {h + "mlp.shared_expert.down_proj.weight": t}
    if rest == "mlp.shared_experts.gate_weight":
        return {h + "mlp.shared_expert_gate.weight": t}
    expert = _EXPERT.match(name)
    if expert and expert.group(3) in (".linear_fc1.weight", ".linear_fc2.weight"):
        # Checkpoint (per-expert) names at the expert's global index; _export.fuse_layer joins them.
        e = int(expert.group(2)) + local_experts(cfg).start
        if expert.group(3) == ".linear_fc1.weight":
            return {h + f"mlp.experts.{e}.gate_proj.weight": t[0], h + f"mlp.experts.{e}.up_proj.weight": t[1]}
        return {h + f"mlp.experts.{e}.down_proj.weight": t}
    raise KeyError(f"no HF name for Megatron tensor {name!r}")
