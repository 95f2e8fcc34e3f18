"""The `megatron` engine's weights (or main gradients) out in Hugging Face names, streamed: what weight sync,
`get_weights`, `save` and `compute_gradients` read (engine.MegatronTrainEngine._export).

Nothing holds the whole model in transit. The export goes piece by piece, a piece being one Megatron tensor's HF
tensors (gathered over TP: q/k/v of one `linear_qkv`, gate/up of one `linear_fc1`, ...) or one MoE layer's experts
(each gathered over the expert TP group, stacked as transformers' fused `gate_up_proj` (E, 2I, H) and
`down_proj` (E, H, I), and all-gathered over expert parallelism into the layer's E experts). Under pipeline
parallelism the stages take turns, first to last: the owning stage broadcasts each piece over the pipeline group
(its names, shapes and dtypes as an object, then its tensors), so every rank yields the same pairs in the same
order (the Megatron model's: embeddings, layer after layer, final norm, output layer or value head) and holds at
most one piece (at most one layer) beyond its own shards.

Tensors keep their dtype (a bf16 model exports bf16: the trainer casts to the inference engine's dtype anyway)
unless the caller asks for one (`get_weights` and `save` keep fp32 checkpoints); at TP=1 a tensor that needs no
conversion (a norm, o_proj, down_proj) is the parameter itself, not a copy.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from roll_engines.train.megatron import _convert as C
from roll_engines.train.megatron import _critic as V
from roll_engines.train.megatron import _lora as L

Piece = list[tuple[str, Tensor]]
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def local_tensors(model: Any, lora: bool, grads: bool, changed_only: bool) -> Iterator[tuple[str, Tensor]]:
    """(Megatron name, this rank's tensor): weights (LoRA merged) or copies of main gradients."""
    if lora and not grads:
        yield from L.local_weights(model, changed_only)
        return
    for name, p in model.named_parameters():
        t = getattr(p, "main_grad", None) if grads else p.data
        # Gradients are views of DDP's buffer, which the next zero_grad_buffer() clears: copy them.
        yield name, (torch.zeros_like(p) if t is None else (t.clone() if grads else t)).detach()


def stage_pieces(
    local: Iterator[tuple[str, Tensor]], hf_config: Any, critic: bool, offset: int, dtype: torch.dtype | None
) -> Iterator[Piece]:
    """This pipeline stage's pieces, in its parameters' order (collective over the TP and EP groups: every rank
    of the stage walks the same parameters). `offset`: the stage's first global layer."""
    experts: dict[str, Tensor] = {}  # per-expert HF tensors of the MoE layer being gathered
    layer = None
    for name, t in local:
        if dtype is not None:
            t = t.to(dtype)
        expert = C.is_expert(name)
        here = _LAYER.match(name)
        if experts and (not expert or here is None or here.group(1) != layer):
            yield fuse_layer(experts, hf_config)
            experts = {}
        if critic and name.startswith("output_layer."):  # the replicated value head
            yield list(V.to_hf(name, t).items())
            continue
        hf = C.to_hf(name, C.gather_tp(name, t), hf_config, offset)
        del t
        if expert:
            experts.update(hf)
            layer = here.group(1) if here else None
        elif hf:  # (a tied output layer has no HF tensor of its own)
            yield list(hf.items())
        del hf
    if experts:
        yield fuse_layer(experts, hf_config)


def fuse_layer(experts: dict[str, Tensor], hf_config: Any) -> Piece:
    """One MoE layer's per-expert HF tensors (this EP rank's experts, `mlp.experts.{e}.{gate,up,down}_proj.weight`)
    as transformers' fused tensors of all the layer's experts (all-gathered over EP: collective)."""
    from megatron.core import parallel_state as ps

    mine = C.local_experts(hf_config)
    prefix = next(iter(experts)).split(".experts.")[0] + ".experts."
    ep = ps.get_expert_model_parallel_world_size()
    out: Piece = []
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        tensors = [[experts.pop(f"{prefix}{e}.{p}.weight") for p in parts] for e in mine]
        local = torch.stack([torch.cat(ts) if len(ts) > 1 else ts[0] for ts in tensors])  # (E/ep, ...)
        del tensors
        if ep > 1:  # EP rank p holds experts p * E/ep ...: the ranks' blocks in rank order are the experts in order
            full = local.new_empty(ep * local.shape[0], *local.shape[1:])
            dist.all_gather(list(full.chunk(ep)), local, group=ps.get_expert_model_parallel_group())
            local = full
        out.append((prefix + fused, local))
        del local
    return out


def over_stages(pieces: Iterator[Piece], device: torch.device) -> Iterator[Piece]:
    """Every pipeline stage's pieces on every rank of the pipeline group, stage after stage (collective over the
    PP group): the owning stage broadcasts each piece's (name, shape, dtype) list, then its tensors, and None
    when it has no more."""
    from megatron.core import parallel_state as ps

    n = ps.get_pipeline_model_parallel_world_size()
    if n == 1:
        yield from pieces
        return
    group, me = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    for stage in range(n):
        src = dist.get_global_rank(group, stage)
        while True:
            piece = next(pieces, None) if stage == me else None
            meta: list[Any] = [None if piece is None else [(k, v.shape, v.dtype) for k, v in piece]]
            dist.broadcast_object_list(meta, src=src, group=group)
            if meta[0] is None:
                break
            if piece is not None:
                tensors = [v.contiguous() for _, v in piece]
            else:
                tensors = [torch.empty(shape, dtype=dt, device=device) for _, shape, dt in meta[0]]
            del piece
            for t in tensors:
                dist.broadcast(t, src=src, group=group)
            yield [(k, t) for (k, _, _), t in zip(meta[0], tensors)]
            del tensors


def pairs(pieces: Iterator[Piece], context: Callable[[], contextlib.AbstractContextManager]) -> Iterator[tuple]:
    """The pieces' (name, tensor) pairs one by one; each piece is made (its collectives run) inside `context()`
    (the engine's shims), the pairs are yielded outside it: the consumer's own code between two pairs runs
    without them."""
    while True:
        with context():
            piece = next(pieces, None)
        if piece is None:
            return
        while piece:
            yield piece.pop(0)  # the consumer alone holds a yielded pair
        piece = None


def all_stages(local: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every pipeline stage's `local` tensors (gathered as objects over the PP group; collective): for the small
    LoRA adapters only, whose save and gradients need them whole."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return local
    stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, {k: v.cpu() for k, v in local.items()}, group=ps.get_pipeline_model_parallel_group())
    return {k: v for s in stages for k, v in s.items()}
