"""Log-probs and entropies of response tokens from Megatron's vocab-parallel logits (each TP rank holds V/TP of
the vocabulary, padded to a multiple of TP), without gathering the vocabulary.

Log-probs come from Megatron's `vocab_parallel_cross_entropy`. The entropy H = log Z + m - sum_v e_v x_v / Z (with
m the max logit, e_v = exp(x_v - m), Z = sum_v e_v) needs three sums over the vocabulary: the max is all-reduced
without gradient (H does not depend on it), Z and sum e x are all-reduced by reduce_from_tensor_model_parallel_region,
whose backward is the identity, which is right because every TP rank computes the same H from the same sums. So the
entropy is differentiable (the entropy bonus trains) and costs two (..., 1) all-reduces instead of a (..., V) gather.
Padding rows of the vocabulary are masked out of both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


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


def response_logprobs(
    logits: Tensor, micro: Mapping[str, Any], temperature: float, entropy: bool, vocab_size: int
) -> dict[str, Tensor]:
    """Log-probs (B, R) of a micro-batch's response tokens (and their entropies (B, R), differentiable) from the
    last stage's logits (B, S/CP, V/tp): padded rows, or the packed layout of micro["_packed"].

    Under context parallelism each CP rank holds the logits of its contiguous slice of every sequence: it scores
    the response tokens predicted from its slice, and one sum over CP (backward: identity, each rank's logits only
    feed its own tokens) gives every rank all of them. That moves K floats per output instead of all-gathering
    the (B, S, V/tp) logits, which at a 150k vocabulary would be the largest tensor of the step."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    b, n = logits.shape[:2]
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    s = n * cp
    grid = torch.arange(b * s, device=logits.device).view(b, s)  # each position's flat index in the whole batch
    packed = micro.get("_packed")
    if packed is not None:
        # The predicting positions, then one row per response token (a prompt's last position predicts the first
        # token of each of its responses).
        rows, targets = grid[packed.keep][packed.source], packed.targets
        shape = None
    else:
        resp = micro["responses"].to(logits.device)
        r = resp.shape[1]
        rows, targets = grid[:, -r - 1 : -1].reshape(-1), resp.reshape(-1)  # (B * R,)
        shape = (b, r)
    pos = rows % s
    mine = torch.nonzero(pos // n == cp_rank).squeeze(-1)  # the rows this CP rank's slice predicts
    local = (rows[mine] // s) * n + pos[mine] - cp_rank * n
    x = logits.reshape(b * n, -1)[local][:, None].float() / temperature  # (k, 1, V/tp): Megatron's (s, b, v)
    vp = x.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vp
    pad = torch.arange(start, start + vp, device=x.device) >= vocab_size
    nll = tensor_parallel.vocab_parallel_cross_entropy(
        x.masked_fill(pad, float("-inf")).contiguous(), targets[mine][:, None].contiguous()
    )
    parts = {"logprobs": -nll[:, 0]}
    if entropy:
        parts["entropy"] = vocab_parallel_entropy(x, pad)[:, 0]
    out = {}
    for key, v in parts.items():
        whole = v.new_zeros(rows.shape[0]).index_put((mine,), v)  # (K,), zeros where another CP rank predicts
        if cp > 1:
            whole = tensor_parallel.reduce_from_tensor_model_parallel_region(whole, ps.get_context_parallel_group())
        out[key] = packed.scatter(whole) if packed is not None else whole.view(shape)
    return out
