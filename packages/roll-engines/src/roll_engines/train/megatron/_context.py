"""Context parallelism for the `megatron` engine on Megatron's local layer spec (no Transformer Engine needed).

Megatron-Core splits attention over context-parallel (CP) ranks only inside Transformer Engine's attention; its
local DotProductAttention refuses CP. This module gives the local spec all-gather context parallelism (the scheme
Llama 3 trained long contexts with): each CP rank of a replica holds one contiguous 1/CP slice of every sequence
(tokens, positions, and the rows of the attention mask for its queries), and every attention layer all-gathers
keys and values over the CP group, so local queries attend to the whole sequence under the mask given. The
gather's backward reduce-scatters dK and dV, so each rank's key/value projections receive the gradient of every
query that attended to them. Everything else in a layer (norms, MLPs, residuals) is per token and needs nothing.

Memory: activations and the attention scores of a layer shrink by CP (scores are (S/CP) x S instead of S x S);
keys and values are whole during one layer's attention. Compute per rank is balanced without Megatron's
zig-zag split, because the full (S/CP) x S score matrix is computed under the mask (masked blocks are not
skipped, unlike TE's ring attention).

The last stage computes logits per CP rank, for the response tokens its slice predicts only, and one sum over CP
(backward: identity) gives every rank all of their log-probs (_vocab.response_logprobs), so no logits are
gathered. A critic's values, one per position, are all-gathered instead (`gather_logits`). Either way log-probs,
values and losses are the unsplit model's on every CP rank, and each rank's parameter gradients are those of its
own tokens; Megatron's data-parallel reduction runs over DP x CP and sums them.
"""

from __future__ import annotations

from typing import Any

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor


class ContextParallelAttention(DotProductAttention):
    """Megatron's local attention over keys and values all-gathered across the CP group.

    Inputs as DotProductAttention's: query (S/CP, b, np, hn), key and value (S/CP, b, ng, hn), attention_mask
    (b, 1, S/CP, S) True where blocked; output (S/CP, b, np * hn)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        import copy

        whole = copy.copy(config)
        whole.context_parallel_size = 1  # the parent refuses CP; here it only ever sees whole keys and values
        super().__init__(whole, *args, **kwargs)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *args: Any, **kw: Any):
        group = ps.get_context_parallel_group()
        key = gather_from_sequence_parallel_region(key, True, group)  # backward: reduce-scatter dK
        value = gather_from_sequence_parallel_region(value, True, group)
        return super().forward(query, key, value, attention_mask, *args, **kw)


def local_slice(ids: Tensor, pos: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """This CP rank's part of a micro-batch: ids and pos (b, S) -> (b, S/CP), mask (b, 1, S, S) -> (b, 1, S/CP, S)
    (its queries' rows, every key). S must be a multiple of CP (the engine pads it)."""
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    if cp == 1:
        return ids, pos, mask
    n = ids.shape[1] // cp
    rows = slice(rank * n, (rank + 1) * n)
    return ids[:, rows], pos[:, rows], mask[:, :, rows]


def gather_logits(logits: Tensor) -> Tensor:
    """(b, S/CP, v) outputs of this rank's slice (a critic's values, v = 1) -> (b, S, v), identical on every CP
    rank; the backward hands each rank the gradient of its own slice."""
    if ps.get_context_parallel_world_size() == 1:
        return logits
    whole = gather_from_sequence_parallel_region(
        logits.transpose(0, 1).contiguous(), False, ps.get_context_parallel_group()
    )
    return whole.transpose(0, 1)
