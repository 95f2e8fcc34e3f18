"""Log-probs and entropies of response tokens from Megatron's vocab-parallel logits (each TP rank holds V/TP of
the vocabulary, padded to a multiple of TP), without gathering the vocabulary.

Log-probs come from Megatron's `vocab_parallel_cross_entropy`. The entropy H = log Z + m - sum_v e_v x_v / Z (with
m the max logit, e_v = exp(x_v - m), Z = sum_v e_v) needs three sums over the vocabulary: the max is all-reduced
without gradient (H does not depend on it), Z and sum e x are all-reduced by reduce_from_tensor_model_parallel_region,
whose backward is the identity, which is right because every TP rank computes the same H from the same sums. So the
entropy is differentiable (the entropy bonus trains) and costs two (..., 1) all-reduces instead of a (..., V) gather.
Padding rows of the vocabulary are masked out of both.

Top-k log-probs (a distillation teacher's, no gradient): each TP rank takes the top-k of its shard, shifted by the
global log-sum-exp (max all-reduced, then the sum of exponentials), the (TP, k) candidates are all-gathered and
merged into the global top-k: k floats and ids per rank instead of the vocabulary. Log-probs at given ids (a student's
at its teacher's top-k ids, differentiable): each rank reads the ids its shard holds (0 elsewhere) and one sum over
TP gives all of them, with the same differentiable log-sum-exp as the entropy.

The output layer runs on the response tokens' predicting positions only (`logits_at`), as the hf engine's does: an
RL sequence is mostly prompt, and the (S, V/TP) logits of every position would be the largest tensors of the step
(S = 8192 at a 152k vocabulary: 5 GB in fp32 per sequence, and as much again for their gradient). Under sequence
parallelism each TP rank holds S/TP positions and the output layer all-gathers its input over TP, so every rank
passes the same number of rows (its own, padded) and the logits of a token are found at its shard's block.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _global_max(x: Tensor) -> Tensor:
    """(..., 1) max over the whole vocabulary of the TP-sharded `x` (..., V/tp), without gradient."""
    from megatron.core import parallel_state as ps

    m = x.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    return m


def vocab_parallel_lse(x: Tensor) -> Tensor:
    """log sum_v exp(x_v) (...) over the whole vocabulary; x: (..., V/tp) fp32 with padding rows at -inf.
    Differentiable (the sum is reduced with an identity backward: every rank holds the same total)."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    m = _global_max(x)
    return torch.log(reduce_from_tensor_model_parallel_region(torch.exp(x - m).sum(dim=-1))) + m.squeeze(-1)


def vocab_parallel_topk(x: Tensor, k: int, start: int) -> tuple[Tensor, Tensor]:
    """(ids (n, k) long, log-probs (n, k) fp32) of the global top-k, sorted descending; x: (n, V/tp) fp32 logits
    of this TP rank (padding rows at -inf), its shard starting at vocabulary id `start`. Collective over TP."""
    from megatron.core import parallel_state as ps

    lse = vocab_parallel_lse(x)
    local = min(k, x.shape[-1])
    values, ids = torch.topk(x, local, dim=-1, sorted=True)
    values, ids = values - lse[:, None], ids + start
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        group = ps.get_tensor_model_parallel_group()
        all_values = [torch.empty_like(values) for _ in range(tp)]
        all_ids = [torch.empty_like(ids) for _ in range(tp)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_ids, ids.contiguous(), group=group)
        values, ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)  # (n, tp * local) candidates
    values, at = torch.topk(values, k, dim=-1, sorted=True)
    return torch.gather(ids, -1, at), values


def vocab_parallel_gather(x: Tensor, ids: Tensor, start: int, vocab_size: int) -> Tensor:
    """Log-probs (n, K) at token `ids` (n, K) over the whole vocabulary; x: (n, V/tp) fp32 logits of this TP rank
    (padding rows at -inf), its shard starting at `start`. Differentiable in x; collective over TP."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    ids = ids.to(x.device).long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"gather ids must be token ids in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
    local = ids - start
    mine = (local >= 0) & (local < x.shape[-1])
    picked = torch.gather(x, -1, local.clamp(0, x.shape[-1] - 1)).masked_fill(~mine, 0.0)
    return reduce_from_tensor_model_parallel_region(picked) - vocab_parallel_lse(x)[:, None]


def vocab_parallel_entropy(x: Tensor, pad: Tensor) -> Tensor:
    """Entropy (...) of softmax(x) over the whole vocabulary; x: (..., V/tp) fp32 logits of this TP rank, pad: (V/tp,)
    True at padding rows. Differentiable in x; collective over the TP group."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    x = x.masked_fill(pad, float("-inf"))
    m = x.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(x - m)  # 0 at padding rows
    z = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    ex = reduce_from_tensor_model_parallel_region((e * x.masked_fill(pad, 0.0)).sum(dim=-1))
    return torch.log(z) + m.squeeze(-1) - ex / z


@dataclasses.dataclass
class ResponseRows:
    """Where a micro-batch's K response tokens are predicted, as one rank sees it (`response_rows`)."""

    mine: Tensor  # (k,) the tokens this CP rank's slice predicts, as indices into the K
    targets: Tensor  # (k,) their token ids
    picked: Tensor  # (c,) rows of this rank's output-layer input (s, b, H) to compute, flat s * b_size + b
    at: Tensor  # (k,) row of each of `mine` in the output layer's (shards * c) output rows
    total: int  # K
    shape: tuple[int, int] | None  # (B, R) of a padded micro-batch; None when packed (packed.scatter places them)


def response_rows(micro: Mapping[str, Any], b: int, n: int, sequence_parallel: bool, device: Any) -> ResponseRows:
    """The response positions of a micro-batch of b rows of S = n * CP tokens (padded rows, or the packed layout
    of micro["_packed"]) that this rank's output layer must compute: its CP slice's n positions per row, and under
    sequence parallelism its TP shard's n / TP of them (every TP rank of the slice gets as many rows, padded)."""
    from megatron.core import parallel_state as ps

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    s = n * cp
    grid = torch.arange(b * s, device=device).view(b, s)  # each position's flat index in the whole batch
    packed = micro.get("_packed")
    if packed is not None:
        # The predicting positions, then one row per response token (a prompt's last position predicts the first
        # token of each of its responses).
        rows, targets = grid[packed.keep][packed.source], packed.targets.to(device)
        shape = None
    else:
        resp = micro["responses"].to(device)
        r = resp.shape[1]
        rows, targets = grid[:, -r - 1 : -1].reshape(-1), resp.reshape(-1)  # (B * R,)
        shape = (b, r)
    pos = rows % s
    mine = torch.nonzero(pos // n == cp_rank).squeeze(-1)
    local, row = pos[mine] - cp_rank * n, rows[mine] // s  # position in this slice, batch row
    sp = sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
    shards = ps.get_tensor_model_parallel_world_size() if sp else 1
    m = n // shards
    shard = local // m
    counts = torch.bincount(shard, minlength=shards)
    c = max(int(counts.max()), 1)  # >= 1: an all-gather of nothing is not portable
    order = torch.argsort(shard, stable=True)
    within = torch.empty_like(order)
    within[order] = torch.arange(len(order), device=device) - (torch.cumsum(counts, 0) - counts)[shard[order]]
    own = shard == (ps.get_tensor_model_parallel_rank() if sp else 0)
    picked = torch.zeros(c, dtype=torch.long, device=device)  # padding rows compute position 0 and are never read
    picked[within[own]] = (local[own] % m) * b + row[own]
    return ResponseRows(mine, targets[mine], picked, shard * c + within, len(rows), shape)


@contextlib.contextmanager
def logits_at(model: Any, plan: ResponseRows) -> Iterator[None]:
    """Within it, `model`'s output layer (last stage) computes the rows `plan.picked` of its input only: Megatron's
    GPTModel then returns (1, shards * c, V/tp) logits instead of (b, n, V/tp). The layer's own forward runs on
    the rows (its collectives, LoRA adapters, tied weights and gradients as usual)."""
    layer = model.output_layer
    original = layer.forward

    def on_rows(hidden: Tensor, *args: Any, **kwargs: Any) -> Any:
        flat = hidden.reshape(-1, hidden.shape[-1])  # (s * b, H), sequence-major as Megatron holds it
        return original(flat[plan.picked][:, None], *args, **kwargs)  # (c, 1, H)

    layer.forward = on_rows
    try:
        yield
    finally:
        del layer.forward  # the class's forward again


def response_logprobs(
    logits: Tensor,
    micro: Mapping[str, Any],
    plan: ResponseRows,
    temperature: float,
    entropy: bool,
    vocab_size: int,
    topk: int = 0,
    gather_ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """Log-probs (B, R) of a micro-batch's response tokens (and their entropies (B, R), differentiable) from the
    last stage's logits (1, shards * c, V/tp) at the rows of `plan` (`logits_at`). `topk=K` adds "topk_ids" and
    "topk_logprobs" (B, R, K); `gather_ids` (B, R, K') adds "gathered_logprobs" (B, R, K'), the log-probs at those
    ids (roll_engines.train._logits has the same outputs of the hf engine).

    Under context parallelism each CP rank computed the logits of the response tokens its slice predicts: one sum
    over CP (backward: identity, each rank's logits only feed its own tokens) gives every rank all of them. That
    moves K floats per output instead of all-gathering logits."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    x = logits[0, plan.at][:, None].float() / temperature  # (k, 1, V/tp): Megatron's (s, b, v)
    vp = x.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vp
    pad = torch.arange(start, start + vp, device=x.device) >= vocab_size
    nll = tensor_parallel.vocab_parallel_cross_entropy(
        x.masked_fill(pad, float("-inf")).contiguous(), plan.targets[:, None].contiguous()
    )
    parts = {"logprobs": -nll[:, 0]}
    if entropy:
        parts["entropy"] = vocab_parallel_entropy(x, pad)[:, 0]
    masked = x[:, 0].masked_fill(pad, float("-inf"))  # (k, V/tp)
    if topk > 0:
        if topk > vocab_size:
            raise ValueError(f"topk={topk} must be between 0 (off) and the vocabulary size {vocab_size}")
        parts["topk_ids"], parts["topk_logprobs"] = vocab_parallel_topk(masked, topk, start)
    if gather_ids is not None:
        ids = gather_ids[micro["_packed"].rows, micro["_packed"].cols] if plan.shape is None else gather_ids
        ids = ids.to(x.device).reshape(plan.total, -1)[plan.mine]  # (k, K') ids of the tokens this rank predicts
        parts["gathered_logprobs"] = vocab_parallel_gather(masked, ids, start, vocab_size)
    out = {}
    for key, v in parts.items():
        # (K, ...), zeros where another CP rank predicts
        whole = v.new_zeros((plan.total, *v.shape[1:])).index_put((plan.mine,), v)
        if ps.get_context_parallel_world_size() > 1:
            if whole.is_floating_point():
                group = ps.get_context_parallel_group()
                whole = tensor_parallel.reduce_from_tensor_model_parallel_region(whole, group)
            else:  # ids: no gradient
                dist.all_reduce(whole, group=ps.get_context_parallel_group())
        out[key] = micro["_packed"].scatter(whole) if plan.shape is None else whole.view(*plan.shape, *whole.shape[1:])
    return out
