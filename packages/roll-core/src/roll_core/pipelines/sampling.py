"""Building and merging rollout batches: generations from several rounds or from the async scheduler, and the
informative-group filter of dynamic sampling.

A *generation* is the engine side of a batch before assembly: fields `prompt_ids`, `answer`, `problem_id`,
`finish_reason` and tensors `responses`, `behaviour_logprobs`, `response_mask` (B, R) and `truncated` (B,), rows
grouped per prompt (`group_size` consecutive rows). Merging pads responses to the widest and assembles once, so
rounds of different lengths become one batch with the layout of roll_core.protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from roll_core.pipelines.rollout import PROBLEM_FIELDS, problem_fields
from roll_core.protocol import Batch

GEN_TENSORS = ("responses", "behaviour_logprobs", "response_mask")
SCORE_TENSORS = ("scores", "correct", "formatted")
#: Per-row fields a reward model's normalize=batch adds (the task's score and the model's raw score), read when a
#: step's rows are all in (roll_core.pipelines.reward_model.RewardModelScoring.renormalise), then dropped.
RM_ROW_TENSORS = ("task_scores", "rm_raw")


def pad_right(t: torch.Tensor, width: int, value: float = 0) -> torch.Tensor:
    """(B, R) -> (B, width), padding on the right with `value`."""
    extra = width - t.shape[1]
    return t if extra <= 0 else torch.nn.functional.pad(t, (0, extra), value=value)


def concat_generations(parts: Sequence[Batch], pad_id: int) -> Batch:
    """Rows of every part in order, responses right-padded to the widest (pad id for tokens, 0 elsewhere)."""
    width = max(p["responses"].shape[1] for p in parts)
    padded = []
    for p in parts:
        t = p.tensors()
        for k in GEN_TENSORS:
            if k in t:
                t[k] = pad_right(t[k], width, pad_id if k == "responses" else 0)
        padded.append(Batch(t, p.fields))
    return Batch.concat(padded)


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) scores -> (B / group_size,) bool: groups whose scores are not all equal (they carry GRPO signal)."""
    grouped = scores.view(-1, group_size)
    return (grouped.max(-1).values - grouped.min(-1).values) > 1e-9


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices of the selected groups: (G,) bool -> (rows,) long."""
    return groups.repeat_interleave(group_size).nonzero(as_tuple=True)[0]


def generation_from_samples(groups: Sequence[Any], pad_id: int) -> Batch:
    """A generation from scheduler groups (roll_core.scheduling.scheduler.GroupState, payload = the problem):
    every sample's tokens and behaviour log-probs over all its segments, plus `behaviour_version` (B,) long,
    the oldest weight version any of its tokens was sampled under."""
    samples = [s for g in groups for s in g.samples]
    width = max((len(s.tokens) for s in samples), default=0)
    n = len(samples)
    resp = torch.full((n, width), pad_id, dtype=torch.long)
    logp = torch.zeros((n, width), dtype=torch.float32)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, s in enumerate(samples):
        toks = s.tokens
        if toks:
            resp[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            logp[i, : len(toks)] = torch.tensor(s.logprobs, dtype=torch.float32)
            mask[i, : len(toks)] = 1
    finish = [s.finish or "abort" for s in samples]
    # A vision-language prompt's pictures ride with each of its rows (one shared object per group).
    pictures = {"mm_inputs": [s.group.mm for s in samples]} if any(s.group.mm is not None for s in samples) else {}
    return Batch(
        {
            "responses": resp,
            "behaviour_logprobs": logp,
            "response_mask": mask,
            "truncated": torch.tensor([f == "length" for f in finish], dtype=torch.long),
            "behaviour_version": torch.tensor([s.min_version for s in samples], dtype=torch.long),
        },
        {
            "prompt_ids": [list(s.group.prompt_ids) for s in samples],
            **problem_fields([s.group.payload for s in samples]),
            **pictures,
            "finish_reason": finish,
        },
    )


def merge_scored(tokenizer: Any, parts: Sequence[Batch]) -> Batch:
    """Assembled, scored batches of different response widths -> one assembled batch (rows in order, scores
    kept), as if the rows had been generated in one call."""
    from roll_core.pipelines.rollout import assemble

    prompt_fields = ("prompt_ids", *(k for k in (*PROBLEM_FIELDS, "mm_inputs") if all(k in p for p in parts)))
    gen_keys = (*GEN_TENSORS, "truncated", "finish_reason", *SCORE_TENSORS, *RM_ROW_TENSORS, "routed_experts_rows")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    merged = concat_generations([p.select(*prompt_fields, *(k for k in gen_keys if k in p)) for p in parts], pad)
    return assemble(tokenizer, merged.select(*prompt_fields), merged.select(*(k for k in gen_keys if k in merged)))
