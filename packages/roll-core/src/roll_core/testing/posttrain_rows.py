"""Post-training rows (roll_core.posttrain) for tests: write rows to a JSONL file, load a data file as SFT,
preference or distillation rows the way a post-training run does, and read a batch's trained tokens back as text.

The tokenizers are roll_core.testing.chat_templates' character-level family tokenizers (`family_tokenizer`), so
what a mask covers can be spelt out by hand. torch is imported; pytest is not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.source import PostTrainData, load_rows

__all__ = ["load", "masked_segments", "write_jsonl"]


def write_jsonl(path: Path, rows: list) -> str:
    """Write `rows` to `path`, one a line (a dict as JSON; a str as it is, for rows that are not valid JSON);
    returns the path as a str (a `data.path`)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def load(
    kind: str, tok: Any, *, max_prompt: int = 400, max_response: int = 400, seed: int = 0, **data: Any
) -> PostTrainData:
    """`load_rows` of `kind` (sft | preference | distill) for the tokenizer `tok`, with the model's length limits;
    `data`: the `DataConfig` fields (path, eval_path, min_score, ...)."""
    return load_rows(
        kind, DataConfig(**data), tok, max_prompt_length=max_prompt, max_response_length=max_response, seed=seed
    )


def masked_segments(tok: Any, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Decoded runs of consecutive mask-1 tokens of one row (`ids` and `mask` of equal length)."""
    segs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            segs.append(cur)
            cur = []
    if cur:
        segs.append(cur)
    return [tok.decode(s) for s in segs]
