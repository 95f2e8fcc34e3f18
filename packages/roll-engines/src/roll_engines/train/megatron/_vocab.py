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
    last stage's logits (B, S, V/tp): padded rows, or the packed layout of micro["_packed"]."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    packed = micro.get("_packed")
    if packed is not None:
        # The predicting positions' logits, then one row per response token (a prompt's last position
        # predicts the first token of each of its responses): (K, 1, V/tp) in Megatron's (s, b, v) order.
        x = logits[packed.keep][packed.source][:, None].float() / temperature
        targets = packed.targets[:, None]
    else:
        resp = micro["responses"].to(logits.device)
        r = resp.shape[1]
        x = logits[:, -r - 1 : -1].float().transpose(0, 1) / temperature  # (R, B, V/tp)
        targets = resp.t()
    vp = x.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vp
    pad = torch.arange(start, start + vp, device=x.device) >= vocab_size
    nll = tensor_parallel.vocab_parallel_cross_entropy(
        x.masked_fill(pad, float("-inf")).contiguous(), targets.contiguous()
    )
    out = {"logprobs": -nll.t()}
    if entropy:
        out["entropy"] = vocab_parallel_entropy(x, pad).t()
    if packed is not None:
        out = {k: packed.scatter(v[0]) for k, v in out.items()}  # (K,) -> (B, R)
    return out
