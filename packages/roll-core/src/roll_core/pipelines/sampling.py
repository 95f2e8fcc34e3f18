"""Building and merging rollout batches: generations from several rounds or from the async scheduler, and the
informative-group filter of dynamic sampling.

A *generation* is the engine side of a batch before assembly: fields `prompt_ids`, `answer`, `problem_id`,
`finish_reason` and tensors `responses`, `behaviour_logprobs`, `response_mask` (B, R) and `truncated` (B,), rows
grouped per prompt (`group_size` consecutive rows). Merging pads responses to the widest and assembles once, so
rounds of different lengths become one batch with the layout of roll_core.protocol.
"""

from __future__ import annotations

import itertools
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
    """(B, R) -> (B, width), padding on the right with `value` (`t` itself when R == width).

    Raises:
        ValueError: width < R (padding never cuts tokens off).
    """
    extra = width - t.shape[1]
    if extra < 0:
        raise ValueError(f"pad_right: cannot pad {tuple(t.shape)} to width {width} (it is wider)")
    return t if extra == 0 else torch.nn.functional.pad(t, (0, extra), value=value)


def concat_generations(parts: Sequence[Batch], pad_id: int) -> Batch:
    """Rows of every part in order, responses right-padded to the widest (pad id for tokens, 0 elsewhere)."""
    width = max(p["responses"].shape[1] for p in parts)
    padded = []
    for p in parts:
        t = p.tensors()
        for k in GEN_TENSORS:
            if k in t:
                t[k] = pad_right(t[k], width, pad_id if k == "responses" else 0)
        padded.append(Batch(t, p.fields, p.meta))
    return Batch.concat(padded)


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) scores -> (B / group_size,) bool: groups whose scores are not all equal (they carry GRPO signal).

    Raises:
        ValueError: B not a multiple of group_size, or a NaN score (max/min would call its group uniform and drop
            it silently; the reward guard replaces NaN rewards before this point).
    """
    if group_size < 1 or scores.ndim != 1 or scores.shape[0] % group_size:
        raise ValueError(
            f"informative_groups: {tuple(scores.shape)} scores do not form groups of {group_size} consecutive rows"
        )
    grouped = scores.reshape(-1, group_size).to(torch.float64)  # bool/int scores too; no float32 rounding
    if grouped.isnan().any():
        bad = grouped.isnan().any(-1).nonzero(as_tuple=True)[0].tolist()
        raise ValueError(f"informative_groups: NaN scores in groups {bad[:5]}")
    return (grouped.max(-1).values - grouped.min(-1).values) > 1e-9


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices of the selected groups: (G,) bool -> (rows,) long, ascending (group g holds rows
    g*group_size .. (g+1)*group_size - 1)."""
    if groups.dtype != torch.bool:
        raise ValueError(f"group_rows: groups must be a bool mask, got {groups.dtype}")
    return groups.repeat_interleave(group_size).nonzero(as_tuple=True)[0]


def generation_from_samples(
    groups: Sequence[Any], pad_id: int, task: Any = None, tokenizer: Any = None, stop: Sequence[str] = ()
) -> Batch:
    """A generation from scheduler groups (roll_core.scheduling.scheduler.GroupState, payload = the problem):
    every sample's tokens and behaviour log-probs over all its segments, plus `behaviour_version` (B,) long,
    the oldest weight version any of its tokens was sampled under; the problem fields (`problem_fields`, with the
    `task`'s prompt messages when given).

    `stop` (the sampling's stop strings, read with `tokenizer`): a sample resumed after an abort (the engine's own, a
    lost request) is cut at the token that completes a stop string begun before a resume point, finish "stop", as
    the same sample never aborted ended (no engine saw that string whole; roll_core.agentic.resume_stops)."""
    from roll_core.agentic.resume_stops import split_stop

    samples = [s for g in groups for s in g.samples]
    rows = [(s.tokens, s.logprobs, s.finish or "abort", s.min_version) for s in samples]
    if stop:
        if tokenizer is None:
            raise ValueError("generation_from_samples: stop strings need the tokenizer (a split one is cut)")
        for i, s in enumerate(samples):
            starts = list(itertools.accumulate(len(seg.tokens) for seg in s.segments))[:-1]  # resume points
            cuts = (split_stop(tokenizer, s.group.prompt_ids, rows[i][0], b, stop) for b in starts)
            cut = next((c for c in cuts if c is not None), None)
            if cut is not None:
                kept = [seg.version for seg, b in zip(s.segments, [0, *starts]) if b < cut and seg.tokens]
                rows[i] = (rows[i][0][:cut], rows[i][1][:cut], "stop", min(kept, default=s.min_version))
    width = max((len(r[0]) for r in rows), default=0)
    n = len(samples)
    resp = torch.full((n, width), pad_id, dtype=torch.long)
    logp = torch.zeros((n, width), dtype=torch.float32)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, (toks, lps, _, _) in enumerate(rows):
        if toks:
            resp[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            logp[i, : len(toks)] = torch.tensor(lps, dtype=torch.float32)
            mask[i, : len(toks)] = 1
    finish = [r[2] for r in rows]
    # A vision-language prompt's pictures ride with each of its rows (one shared object per group).
    pictures = {"mm_inputs": [s.group.mm for s in samples]} if any(s.group.mm is not None for s in samples) else {}
    return Batch(
        {
            "responses": resp,
            "behaviour_logprobs": logp,
            "response_mask": mask,
            "truncated": torch.tensor([f == "length" for f in finish], dtype=torch.long),
            "behaviour_version": torch.tensor([r[3] for r in rows], dtype=torch.long),
        },
        {
            "prompt_ids": [list(s.group.prompt_ids) for s in samples],
            **problem_fields([s.group.payload for s in samples], task),
            **pictures,
            "finish_reason": finish,
        },
    )


def merge_scored(tokenizer: Any, parts: Sequence[Batch]) -> Batch:
    """Assembled, scored batches of different response widths -> one assembled batch (rows in order, scores
    kept, the first part's meta), as if the rows had been generated in one call.

    A part without `mm_inputs` (text only) contributes None per row, the no-pictures value, when other parts
    carry pictures. Raises ValueError when a problem field (PROBLEM_FIELDS) is in some parts only: dropping it
    from the merged batch would silently starve the rewards that read it.
    """
    from roll_core.pipelines.rollout import assemble

    have = {k: sum(k in p for p in parts) for k in (*PROBLEM_FIELDS, "mm_inputs")}
    partial = [k for k, c in have.items() if 0 < c < len(parts) and k != "mm_inputs"]
    if partial:
        raise ValueError(f"merge_scored: fields {partial} are in only some of the {len(parts)} batches")
    if 0 < have["mm_inputs"] < len(parts):
        parts = [p if "mm_inputs" in p else _with_field(p, "mm_inputs", None) for p in parts]
    prompt_fields = ("prompt_ids", *(k for k in (*PROBLEM_FIELDS, "mm_inputs") if all(k in p for p in parts)))
    gen_keys = (*GEN_TENSORS, "truncated", "finish_reason", *SCORE_TENSORS, *RM_ROW_TENSORS, "routed_experts_rows")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    merged = concat_generations([p.select(*prompt_fields, *(k for k in gen_keys if k in p)) for p in parts], pad)
    return assemble(tokenizer, merged.select(*prompt_fields), merged.select(*(k for k in gen_keys if k in merged)))


def _with_field(batch: Batch, key: str, value: Any) -> Batch:
    """A shallow copy of `batch` with field `key` set to `value` on every row."""
    return Batch(batch.td, {**batch.fields, key: [value] * len(batch)}, batch.meta)
