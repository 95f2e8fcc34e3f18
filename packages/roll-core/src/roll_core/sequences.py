"""Sequence layout helpers in plain torch (no TensorDict): left-padded prompts, right-padded responses.

Layout (roll_core.protocol): `input_ids` = cat(prompts, responses) (B, P+R), `attention_mask` (B, P+R),
`position_ids` (B, P+R) counting real tokens only. Kept free of roll-core's heavier imports so that engines and the
accelerator checks (tests/device) run on machines with only torch and transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists to (B, P) ids and a (B, P) attention mask."""
    p = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), p), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), p), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, p - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, p - len(s) :] = 1
    return ids, mask


def build_sequences(
    prompts: Tensor, prompt_mask: Tensor, responses: Tensor, response_mask: Tensor
) -> dict[str, Tensor]:
    """`input_ids`, `attention_mask`, `position_ids` (B, P+R) from left-padded prompts and right-padded responses.

    `response_mask` doubles as the responses' attention mask, so it must be 1 on a prefix of each row (the
    generated tokens) and 0 on the right padding; a response with masked tokens inside (agentic observations)
    sets its own attention mask (roll_core.agentic.trajectory). Position ids count attended tokens from 0; a
    padding position repeats its neighbour's id (it is never attended).

    Raises:
        ValueError: a mask whose shape differs from its ids', or prompts and responses of different row counts
            (a (B, P-1) mask would otherwise silently shift every attention mask against its tokens).
    """
    if prompts.ndim != 2 or responses.ndim != 2:
        raise ValueError(
            f"build_sequences: prompts and responses must be 2-d, got {tuple(prompts.shape)} and "
            f"{tuple(responses.shape)}"
        )
    if prompt_mask.shape != prompts.shape or response_mask.shape != responses.shape:
        raise ValueError(
            f"build_sequences: masks must match their ids: prompts {tuple(prompts.shape)} vs prompt_mask "
            f"{tuple(prompt_mask.shape)}, responses {tuple(responses.shape)} vs response_mask "
            f"{tuple(response_mask.shape)}"
        )
    if prompts.shape[0] != responses.shape[0]:
        raise ValueError(f"build_sequences: {prompts.shape[0]} prompt rows but {responses.shape[0]} response rows")
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
