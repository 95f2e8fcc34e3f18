"""Training batches for tests and device checks, built with torch and transformers only (no pytest, Ray or Hydra):
`tests/device/check_accelerator.py` imports this on bare accelerator machines."""

from __future__ import annotations

import torch

from roll_core.sequences import build_sequences, pad_left

PROMPTS = ["What is 1+2?", "Hi", "abc def ghi"]


def toy_batch(model_path: str) -> dict[str, torch.Tensor]:
    """A training batch in roll's layout: two random responses of different lengths per prompt of `PROMPTS`
    (left-padded prompts, right-padded responses) with advantages of both signs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = [list(tok(p)["input_ids"]) for p in PROMPTS for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7, 5, 1, 6, 4]
    r = max(lengths)
    responses = torch.randint(3, len(tok), (len(prompts), r), generator=gen)
    mask = (torch.arange(r)[None, :] < torch.tensor(lengths)[:, None]).long()
    responses = responses * mask + tok.pad_token_id * (1 - mask)
    p_ids, p_mask = pad_left(prompts, tok.pad_token_id)
    out = build_sequences(p_ids, p_mask, responses, mask)
    out.update(responses=responses, response_mask=mask)
    out["advantages"] = torch.linspace(-1, 1, len(prompts))[:, None] * mask
    return out


def critic_batch(model_path: str) -> dict[str, torch.Tensor]:
    """`toy_batch` plus the old values (B, R) and returns (B, R) a value loss reads (seeded; the returns spread
    beyond the old values' clip range, so value clipping acts)."""
    batch = toy_batch(model_path)
    g = torch.Generator().manual_seed(3)
    shape = batch["response_mask"].shape
    return {**batch, "values": torch.randn(shape, generator=g) * 0.1, "returns": torch.randn(shape, generator=g)}
