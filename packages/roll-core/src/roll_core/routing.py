"""Routed-expert replay's batch field: the experts a MoE rollout engine chose, laid out like `input_ids`.

An inference engine that records routing returns, per request, a (prompt_len + response_len, num_moe_layers,
top_k) int16 tensor of expert ids (`RequestOutput.routed_experts`; -1 where it computed none). The training
engines read the batch field `routed_experts`, (B, P+R, num_moe_layers, top_k) int16 aligned with `input_ids` in
the padded layout of roll_core.protocol (prompts left-padded to P, responses right-padded to R), and compute each
MoE layer with exactly those experts (train_engine.routing_replay). Padding and unrecorded positions hold
UNROUTED (-1): the trainer routes those itself, and `assemble` counts the real ones (`unreplayed`:
routing/unreplayed_positions, routing/unreplayed_rows) so a batch trained largely with the trainer's own routing
shows. The synchronous pipeline carries it: the infer worker puts each request's routing in the generation's
ROUTING_ROWS field (a resumed row's attempts merged by `carry_routing`) and `assemble` lays it out next to
`input_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

#: The batch field (B, P+R, num_moe_layers, top_k) int16.
ROUTED_EXPERTS = "routed_experts"
#: A generation's per-row field before assembly: each request's ragged routing (prompt + response positions);
#: `roll_core.pipelines.rollout.assemble` lays it out as ROUTED_EXPERTS once the prompt width is known.
ROUTING_ROWS = "routed_experts_rows"
#: A position whose experts the engine did not record.
UNROUTED = -1


def routing_layout(
    rows: Sequence[Tensor], prompt_lens: Sequence[int], prompt_width: int, response_width: int
) -> Tensor:
    """Per-request routing -> the batch field (B, P+R, layers, top_k) int16 aligned with `input_ids`.

    Args:
        rows: per row, (positions, layers, top_k) expert ids (RequestOutput.routed_experts) from the prompt's first
            token on: usually prompt_len + generated - 1 positions (the last sampled token is never fed back), so a
            row may stop inside its prompt (no token generated); the positions it lacks stay UNROUTED.
        prompt_lens: per row, its prompt's length (the first prompt_len entries of its routing).
        prompt_width, response_width: P and R of the padded layout (a response longer than R is cut there).
    Raises:
        ValueError: rows of different layer counts or top-k, a row not 3-d, or a prompt longer than P.
    """
    if len(rows) != len(prompt_lens):
        raise ValueError(f"routing_layout: {len(rows)} routings for {len(prompt_lens)} prompts")
    flat = [i for i, r in enumerate(rows) if r.ndim != 3]
    if flat:
        raise ValueError(f"routing_layout: rows {flat[:5]} are not (positions, layers, top_k) tensors")
    shapes = {tuple(r.shape[1:]) for r in rows}
    if len(shapes) > 1:
        raise ValueError(f"routing_layout: rows disagree on (layers, top_k): {sorted(shapes)}")
    tail = shapes.pop() if shapes else (0, 0)
    out = torch.full((len(rows), prompt_width + response_width, *tail), UNROUTED, dtype=torch.int16)
    for i, (r, plen) in enumerate(zip(rows, prompt_lens)):
        if plen > prompt_width:
            raise ValueError(f"routing_layout: row {i}'s prompt has {plen} tokens, more than P={prompt_width}")
        prompt = r[:plen]  # shorter than plen when the engine stopped inside the prompt (nothing generated)
        out[i, prompt_width - plen : prompt_width - plen + prompt.shape[0]] = prompt
        resp = r[plen : plen + response_width]
        out[i, prompt_width : prompt_width + resp.shape[0]] = resp
    return out


def carry_routing(old: Tensor | None, new: Tensor | None, keep: int | None = None) -> Tensor | None:
    """A resumed request's routing `new` with the earlier attempts' `old` wherever `new` recorded nothing.

    Both are (positions, layers, top_k) from the prompt's first token: a resume's prompt is the row's prompt plus
    what it generated, so position j of both is the same token. An attempt that ends without computing anything
    (prompt_too_long, aborted before its prefill) returns all-UNROUTED rows; replacing the row's routing by it
    threw the earlier attempts' away. `keep`: only `old`'s first `keep` positions line up (a restarted row, whose
    response was generated again: its prompt's); None: all of them. `new` None (an engine that returned no
    routing) keeps `old`'s aligned part.
    """
    if old is None:
        return new
    old = old if keep is None else old[:keep]
    if new is None:
        return old
    n = min(old.shape[0], new.shape[0])
    lost = (new[:n] < 0).any(-1, keepdim=True)  # per (position, layer), as the trainer reads it
    # `old` longer than `new` (an engine that returned fewer positions): its tail is of the same tokens
    return torch.cat([torch.where(lost, old[:n], new[:n]), new[n:], old[n:]])


def unreplayed(routed: Tensor, attention_mask: Tensor) -> tuple[int, int]:
    """(positions, rows) of the batch field `routed` (B, T, layers, top_k) the trainer routes itself for want of a
    record: real positions (`attention_mask`) with some MoE layer UNROUTED, each row's last one excepted (the last
    token is never fed back to the engine, so it never has a record, and its output predicts nothing trained),
    and rows none of whose counted positions has a record. Padding is not counted."""
    real = attention_mask.bool().clone()
    last = real.shape[1] - 1 - real.flip(1).int().argmax(1)  # each row's last real position
    has = real.any(1)
    real[has.nonzero().flatten(), last[has]] = False
    lost = (routed.flatten(2) < 0).any(-1) & real
    counted = real.sum(1)
    rows = int(((lost.sum(1) == counted) & (counted > 0)).sum())
    return int(lost.sum()), rows
