"""LoRA adapters on Megatron-Core's tensor-parallel linear layers (the `megatron` engine's `lora_rank > 0`).

Contract (the same as roll_engines.train._lora for the transformers engines): only adapters train; the base with
adapters disabled is the reference policy; weight sync and `model/` carry merged weights (W + alpha/r * B @ A) in
HF names; `adapter/` holds a peft adapter folder that `PeftModel.from_pretrained` loads on the HF model.

Tensor parallelism, y = W x + s * B A x with r the rank:

| layer (parallel kind) | W shard | A | B | between A and B (tp region) |
|---|---|---|---|---|
| linear_qkv, linear_fc1 (column) | rows | (r, in) replicated | (out/tp, r) rows | copy_to_ |
| linear_proj, linear_fc2 (row) | columns | (r, in/tp) columns | (out, r) replicated | reduce_from_ |
| output_layer = lm_head (vocab, last stage) | vocab rows | (r, hidden) replicated | (vocab/tp, r) rows | copy_to_ |

The copy all-reduces dA's upstream gradient in backward (each rank's B shard sees only its rows); the reduce sums
the partial A x of the column shards in forward. Under sequence parallelism a column layer's input holds 1/TP of
the sequence and a row layer's output must too: the copy becomes gather_from_sequence_parallel_region (forward
all-gather, backward reduce-scatter) and the reduce becomes reduce_scatter_to_sequence_parallel_region, the same
collectives the base layer runs; the replicated factor (column A, row B) then sees one sequence shard per rank, so
it is marked `sequence_parallel` and Megatron sums its gradient over TP. Each rank's merged shard is then
W_shard + s * B_local @ A_local, which the engine gathers and names like the base weight.

`lm_head` is adapted only when named (peft's "all-linear" leaves the output layer out too), and only untied: with
tied embeddings a merged lm_head would change the input embeddings as well. Its B rows cover the padded vocabulary;
the padding rows get no gradient (their logits are masked) and are dropped on export.

Checkpoints: the base layer's entries keep their own keys (Megatron's MLP and LanguageModule post-process them by
name: the swiglu split of linear_fc1, the output layer's padded shape); the adapters are `<layer>.lora_a/lora_b`.
A peft adapter loads only whole: one that adapts a layer this run does not target, or uses an option these
wrappers do not compute (rsLoRA, DoRA, per-layer ranks, biases), is refused rather than loaded in part.

Megatron fuses q/k/v (and gate/up) in one layer, so one A serves the three (two) HF projections: targets list all
of a fused group or none, and the exported peft adapter repeats A for each, with B split like the fused weight.
A starts as peft's (uniform in +-1/sqrt(in)), drawn from the full matrix with a per-layer seed, so every TP/PP
layout starts from the same adapter; B starts at zero (the adapted model starts as the base).
"""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from roll_engines.train.megatron import _convert as C

# Megatron layer -> (its parent in a TransformerLayer, or None: the GPTModel itself; the HF projections it fuses;
# parallel kind).
LAYERS = {
    "linear_qkv": ("self_attention", ("q_proj", "k_proj", "v_proj"), "column"),
    "linear_proj": ("self_attention", ("o_proj",), "row"),
    "linear_fc1": ("mlp", ("gate_proj", "up_proj"), "column"),
    "linear_fc2": ("mlp", ("down_proj",), "row"),
    "output_layer": (None, ("lm_head",), "column"),
}
PEFT = "base_model.model."


def resolve_targets(targets: list[str] | str) -> list[str]:
    """Megatron layers for peft-style `targets` ("all-linear": every decoder projection, not lm_head; HF projection
    names; or Megatron layer names)."""
    if targets == "all-linear":
        return [layer for layer, (parent, _, _) in LAYERS.items() if parent is not None]
    names = [targets] if isinstance(targets, str) else [str(t) for t in targets]
    known = {n for layer, (_, hf, _) in LAYERS.items() for n in (layer, *hf)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(
            f"train_engine.lora_target_modules: {unknown} are not adaptable by train_engine=megatron; use "
            f"'all-linear' or names from {sorted(known)}"
        )
    chosen = []
    for layer, (_, hf, _) in LAYERS.items():
        hit = [n for n in names if n in hf]
        if layer in names or hit:
            if layer not in names and set(hit) != set(hf):
                raise ValueError(
                    f"train_engine=megatron fuses {'/'.join(hf)} into one layer ({layer}) that shares one LoRA A: "
                    f"target all of {list(hf)} or none (got {hit})"
                )
            chosen.append(layer)
    if not chosen:
        raise ValueError("train_engine.lora_target_modules selects no layer")
    return chosen


class LoRAParallelLinear(torch.nn.Module):
    """A Megatron Column/RowParallelLinear plus a LoRA branch (see the module docstring's table)."""

    def __init__(
        self,
        base: torch.nn.Module,
        parallel: str,
        a: Tensor,
        b: Tensor,
        scaling: float,
        glu: bool = False,
        vocab: bool = False,
    ) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.base, self.parallel, self.scaling, self.enabled = base, parallel, scaling, True
        self.glu = glu  # a gated MLP's linear_fc1: each TP shard holds [gate_i; up_i], not a slice of [gate; up]
        self.vocab = vocab  # the output layer: rows are the vocabulary padded to a multiple of TP
        self.lora_a = torch.nn.Parameter(a)  # (r, in) column / (r, in/tp) row
        self.lora_b = torch.nn.Parameter(b)  # (out/tp, r) column / (out, r) row
        # The sharded one counts once per TP rank in Megatron's grad norm; a replicated one on TP rank 0 only.
        if parallel == "column":
            set_tensor_model_parallel_attributes(self.lora_b, True, 0, 1)
        else:
            set_tensor_model_parallel_attributes(self.lora_a, True, 1, 1)
        # Under sequence parallelism the replicated one (column A, row B) sees only this rank's sequence shard, so
        # its gradient is partial: marked, Megatron sums it over TP (as it does for the norms).
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        replicated = self.lora_a if parallel == "column" else self.lora_b
        replicated.sequence_parallel = self.sequence_parallel

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """x: (s, b, in) (column) or (s, b, in/tp) (row) -> ((s, b, out/tp) or (s, b, out), bias); under sequence
        parallelism a column layer's x and a row layer's output hold s/tp positions."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        h = F.linear(x, self.lora_a)
        if self.parallel == "column":
            h = (
                gather_from_sequence_parallel_region(h)
                if self.sequence_parallel
                else copy_to_tensor_model_parallel_region(h)
            )
        elif self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h)
        else:
            h = reduce_from_tensor_model_parallel_region(h)
        delta = F.linear(h, self.lora_b) * self.scaling
        if self.parallel == "column" and (kwargs.get("runtime_gather_output") or self.base.gather_output):
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            delta = gather_from_tensor_model_parallel_region(delta)  # the base gathered its output shards too
        return out + delta, bias

    def merged_weight(self) -> Tensor:
        """This rank's shard of W + s * B @ A (the base weight's shard shape)."""
        w = self.base.weight.detach()
        return w + (self.lora_b.detach().float() @ self.lora_a.detach().float() * self.scaling).to(w.dtype)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """The base layer's entries under the base layer's own keys (the optimizer's distributed checkpoint maps
        each parameter's moments through these by identity, not by name) and the adapters, TP-sharded as in the
        table."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        axis = {"lora_b": 0} if self.parallel == "column" else {"lora_a": 1}
        own = {"lora_a": self.lora_a, "lora_b": self.lora_b}
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, axis, sharded_offsets))
        if self.glu:
            # B's rows follow the weight's ([gate_i; up_i] per TP shard): split it into gate and up as MLP's
            # sharded_state_dict does for `linear_fc1.weight`, so that the checkpoint reshards across TP sizes.
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            singleton = (metadata or {}).get("singleton_local_shards", False)
            out[f"{prefix}lora_b"] = apply_swiglu_sharded_factory(out[f"{prefix}lora_b"], sharded_offsets, singleton)
        if self.vocab:
            # The output layer's rows are the vocabulary padded to a multiple of TP (LanguageModule lets its weight
            # load at another padding): B's rows follow, so a checkpoint loads at another TP size.
            out[f"{prefix}lora_b"].allow_shape_mismatch = True
        return out


def apply_lora(model: Any, rank: int, alpha: float, targets: list[str] | str, seed: int) -> None:
    """Freeze `model` (this stage's GPTModel) and wrap the targeted layers of every transformer layer."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layers = resolve_targets(targets)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = get_transformer_layer_offset(model.config)

    def wrap(parent: torch.nn.Module, name: str, key: str) -> None:
        base, parallel = getattr(parent, name), LAYERS[name][2]
        w = base.weight
        fan_in = w.shape[1] * (tp if parallel == "row" else 1)
        # Seeded by the layer's global identity, so every TP/PP layout draws the same A.
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
        a = torch.empty(rank, fan_in).uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=gen)
        if parallel == "row":
            a = a.chunk(tp, 1)[tp_rank].contiguous()
        a, b = a.to(w.device, w.dtype), torch.zeros(w.shape[0], rank, device=w.device, dtype=w.dtype)
        glu = name == "linear_fc1" and model.config.gated_linear_unit
        setattr(parent, name, LoRAParallelLinear(base, parallel, a, b, alpha / rank, glu, name == "output_layer"))

    if "output_layer" in layers and model.share_embeddings_and_output_weights:
        raise ValueError(
            "train_engine.lora_target_modules names lm_head, which this model ties to its input embeddings: a merged "
            "lm_head would change the embeddings too; leave lm_head out"
        )
    model.requires_grad_(False)
    for i, layer in enumerate(model.decoder.layers):
        for name in layers:
            parent = LAYERS[name][0]
            if parent is None:
                continue
            if not hasattr(getattr(layer, parent), name):  # a MoE layer: experts instead of one MLP
                raise ValueError(
                    f"train_engine=megatron adapts no MoE experts ({name}): set train_engine.lora_target_modules to "
                    "attention projections and/or lm_head, e.g. [q_proj,k_proj,v_proj,o_proj]"
                )
            wrap(getattr(layer, parent), name, f"{i + offset}:{name}")
    if "output_layer" in layers and model.post_process:
        wrap(model, "output_layer", "output_layer")


def wrappers(model: Any) -> list[tuple[str, LoRAParallelLinear]]:
    """(module name, wrapper) of every LoRA layer in `model` (stage-local layer indices)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRAParallelLinear)]


@contextlib.contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """The base model (the reference policy) inside the block."""
    layers = [m for _, m in wrappers(model)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


def local_weights(model: Any, changed_only: bool) -> Iterator[tuple[str, Tensor]]:
    """(Megatron name, this rank's tensor) of the model with adapters merged; `changed_only`: adapted ones only."""
    owners = dict(wrappers(model))
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
            continue
        owner, _, kind = name.rpartition(".base.")
        if owner in owners:
            yield f"{owner}.{kind}", owners[owner].merged_weight() if kind == "weight" else p.detach()
        elif not changed_only:
            yield name, p.detach()


def adapter_tensors(model: Any, hf_config: Any, grads: bool = False) -> dict[str, Tensor]:
    """The adapter in peft's saved names (or its main gradients), full tensors gathered over TP: this stage's
    layers (collective over the TP group)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(model.config)
    out: dict[str, Tensor] = {}
    for prefix, m in wrappers(model):

        def value(p: Tensor) -> Tensor:
            g = getattr(p, "main_grad", None) if grads else p.detach()
            return (torch.zeros_like(p) if g is None else g.clone()).float()

        a, b = value(m.lora_a), value(m.lora_b)
        weight = f"{prefix}.weight"  # the base weight's name: its TP split and HF mapping apply to B (or A)
        if m.parallel == "column":
            for hf_name, part in C.to_hf(weight, C.gather_tp(weight, b), hf_config, offset).items():
                module = PEFT + hf_name.removesuffix(".weight")
                # A copy per projection: peft holds one A each (and safetensors refuses shared storage).
                out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a.cpu().clone(), part.cpu()
        else:
            ((hf_name, a_full),) = C.to_hf(weight, C.gather_tp(weight, a), hf_config, offset).items()
            module = PEFT + hf_name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a_full.cpu(), b.cpu()
    return {k: v.contiguous() for k, v in out.items()}


def adapter_config(rank: int, alpha: float, targets: list[str] | str, base_path: str) -> dict[str, Any]:
    """peft's adapter_config.json for the exported adapter (LoraConfig's fields; peft fills the rest)."""
    modules = sorted(n for layer in resolve_targets(targets) for n in LAYERS[layer][1])
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_path,
    }


def save_adapter(folder: Path, state: dict[str, Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "adapter_model.safetensors"))


def load_adapter(model: Any, hf_config: Any, folder: Path, rank: int, alpha: float, write: bool = True) -> list:
    """Copy a peft adapter folder (ours, or any whose fused projections share A) into this rank's wrappers, all
    checked before any is copied; `write=False` only checks, and returns the (wrapper, A, B) to `write_adapter`."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from roll_engines.train._safetensors_file import read_safetensors

    saved = json.loads((folder / "adapter_config.json").read_text())
    if (saved.get("r"), float(saved.get("lora_alpha", 0))) != (rank, float(alpha)):
        raise ValueError(
            f"{folder}: adapter r={saved.get('r')}, lora_alpha={saved.get('lora_alpha')}; this run has "
            f"lora_rank={rank}, lora_alpha={alpha}. Resume with train_engine.lora_rank={saved.get('r')} and "
            f"train_engine.lora_alpha={saved.get('lora_alpha')}, or start a new run from its merged weights "
            f"(model.path={folder.parent / 'model'})"
        )
    # peft options that change what an adapter computes, which these wrappers (alpha / r, one A per fused layer,
    # no bias) do not: loaded anyway they would give another model, silently
    other = {k: saved[k] for k in _UNSUPPORTED if saved.get(k) not in (None, False, {}, "none")}
    if other:
        raise ValueError(f"{folder}: the adapter uses {other}, which train_engine=megatron's LoRA does not")
    state = read_safetensors(folder / "adapter_model.safetensors")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = get_transformer_layer_offset(model.config)
    used: set[str] = set()

    def get(key: str) -> Tensor:
        if key not in state:
            raise KeyError(f"{folder}: the adapter has no {key} (it adapts other layers than this run's targets)")
        used.add(key)
        return state[key]

    loads = []  # (wrapper, A, B): checked whole before any is copied (a refused load leaves the model as it was)
    for prefix, m in wrappers(model):
        parent, hf, _ = LAYERS[prefix.rsplit(".", 1)[-1]]
        if parent is None:  # the output layer: B's rows padded to the vocabulary Megatron holds
            modules = [f"{PEFT}{hf[0]}"]
        else:
            kind = "self_attn" if parent == "self_attention" else "mlp"
            modules = [f"{PEFT}model.layers.{int(prefix.split('.')[2]) + offset}.{kind}.{n}" for n in hf]
        a_parts = [get(f"{mod}.lora_A.weight") for mod in modules]
        b_parts = [get(f"{mod}.lora_B.weight") for mod in modules]
        if any(not torch.equal(a_parts[0], x) for x in a_parts[1:]):
            raise ValueError(f"{folder}: {hf} have different LoRA A matrices; Megatron's fused {prefix} shares one")
        if parent is None:
            vocab = C.padded_vocab(hf_config.vocab_size, tp)
            a, b = a_parts[0], C.pad_rows(b_parts[0], vocab).chunk(tp, 0)[tp_rank]
        elif m.parallel == "row":
            a, b = a_parts[0].chunk(tp, 1)[tp_rank], b_parts[0]
        elif len(b_parts) == 3:
            a, b = a_parts[0], C.qkv_to_mcore(*b_parts, hf_config).chunk(tp, 0)[tp_rank]
        else:
            a, b = a_parts[0], torch.cat([x.chunk(tp, 0)[tp_rank] for x in b_parts])
        for p, v in ((m.lora_a, a), (m.lora_b, b)):
            if p.shape != v.shape:
                raise RuntimeError(f"{prefix}: adapter shape {tuple(v.shape)} vs this layer's {tuple(p.shape)}")
        loads.append((m, a, b))
    # Adapters of this stage's layers that no wrapper took (the adapter targets more than this run does) would
    # be dropped: the loaded model would not be the saved one.
    layers = range(offset, offset + len(model.decoder.layers))
    left = sorted(k for k in set(state) - used if _stage_key(k, layers, model.post_process))
    if left:
        raise ValueError(
            f"{folder}: the adapter adapts {len(left)} tensors this run does not target ({left[:4]}"
            f"{' ...' if len(left) > 4 else ''}): set train_engine.lora_target_modules to the adapter's "
            f"{saved.get('target_modules')}"
        )
    if write:
        write_adapter(loads)
    return loads


def write_adapter(loads: list) -> None:
    """Copy `load_adapter(..., write=False)`'s checked (wrapper, A, B) triples into the wrappers."""
    with torch.no_grad():
        for m, a, b in loads:
            m.lora_a.copy_(a)
            m.lora_b.copy_(b)


_UNSUPPORTED = ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "bias", "lora_bias", "layers_to_transform")


def _stage_key(key: str, layers: range, last: bool) -> bool:
    """Whether a peft adapter key belongs to this pipeline stage (its decoder `layers`, lm_head on the last)."""
    found = re.match(rf"{re.escape(PEFT)}model\.layers\.(\d+)\.", key)
    if found:
        return int(found.group(1)) in layers
    return last


def fused_gradients(peft_grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """peft's per-projection adapter gradients (saved names, at an adapter whose fused projections share A) as
    this engine reports them: a fused layer's A gradient is the sum over its projections, under each of them."""
    out = dict(peft_grads)
    for _, hf, _ in LAYERS.values():
        for name in peft_grads:
            if name.endswith(f".{hf[0]}.lora_A.weight") and len(hf) > 1:
                names = [name.replace(f".{hf[0]}.", f".{p}.") for p in hf]
                total = sum(peft_grads[n] for n in names)
                out.update({n: total for n in names})
    return out
