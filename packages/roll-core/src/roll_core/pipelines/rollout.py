"""Rollout helpers shared by the RLVR pipeline and `roll-eval`: prompt batches, sequence assembly, evaluation.

A prompt batch holds the chat-templated token ids of each problem (`prompt_ids`), its ground truth (`answer`)
and id (`problem_id`). Prompts longer than the limit are skipped and counted, never truncated (a truncated
question has a different answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from roll_core.protocol import Batch, build_sequences, pad_left


def prompt_batch(
    tokenizer: Any, task: Any, problems: Sequence[Any], max_prompt_length: int, metrics: dict[str, Any]
) -> Batch:
    """Chat-templated prompt ids; `metrics["data/skipped_long_prompts"]` counts the prompts skipped."""
    ids, kept, shortest = [], [], None
    for p in problems:
        toks = tokenizer.apply_chat_template(
            task.messages(p), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        toks = list(toks["input_ids"] if isinstance(toks, dict) else toks)
        shortest = len(toks) if shortest is None else min(shortest, len(toks))
        if len(toks) <= max_prompt_length:
            ids.append(toks)
            kept.append(p)
    metrics["data/skipped_long_prompts"] = len(problems) - len(kept)
    if not kept:
        raise ValueError(
            f"every prompt exceeds model.max_prompt_length={max_prompt_length} (shortest: {shortest} "
            "tokens): raise model.max_prompt_length"
        )
    return Batch(fields={"prompt_ids": ids, "answer": [p.answer for p in kept], "problem_id": [p.id for p in kept]})


def assemble(tokenizer: Any, prompts: Batch, gen: Batch) -> Batch:
    """Prompt rows (already repeated per sample) + generation -> the full sequence layout of roll_core.protocol."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    p_ids, p_mask = pad_left(prompts["prompt_ids"], pad)
    batch = prompts.union(gen)
    batch["prompts"] = p_ids
    for k, v in build_sequences(p_ids, p_mask, gen["responses"], gen["response_mask"]).items():
        batch[k] = v
    return batch


def evaluate(
    infer: Any,
    reward: Any,
    tokenizer: Any,
    task: Any,
    problems: Sequence[Any],
    *,
    max_prompt_length: int,
    temperature: float,
    seed: int,
) -> dict[str, float]:
    """Accuracy and mean reward of one sample per problem."""
    metrics: dict[str, Any] = {}
    prompts = prompt_batch(tokenizer, task, problems, max_prompt_length, metrics)
    gen = infer.generate(prompts, n=1, temperature=temperature, seed=seed)
    scored = reward.score(assemble(tokenizer, prompts, gen))
    return {"accuracy": float(scored["correct"].mean()), "reward": float(scored["scores"].mean()), "n": len(prompts)}
