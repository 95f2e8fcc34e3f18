"""Rollout helpers shared by the RLVR pipeline and `roll-eval`: prompt batches, sequence assembly, evaluation.

A prompt batch holds the chat-templated token ids of each problem (`prompt_ids`), its ground truth (`answer`),
id (`problem_id`), prompt text (`prompt_text`, the user message) and metadata (`metadata`: the problem's
`metadata` with its `domain`), which reach rewards that declare them. Prompts longer than the limit are skipped
and counted, never truncated (a truncated question has a different answer).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from roll_core.interfaces import SamplingParams
from roll_core.protocol import Batch, build_sequences, pad_left

log = logging.getLogger(__name__)


class PromptsTooLong(ValueError):
    """Every prompt of a batch exceeds model.max_prompt_length."""


def _max_token_chars(tokenizer: Any) -> int | None:
    """Characters of the longest vocabulary entry (a token covers at most this many), cached on the tokenizer;
    None when the vocabulary cannot be listed."""
    cached = getattr(tokenizer, "_roll_max_token_chars", None)
    if cached is None:
        try:
            cached = max(len(t) for t in tokenizer.get_vocab())
            tokenizer._roll_max_token_chars = cached
        except Exception:  # an exotic tokenizer: every prompt is tokenised
            return None
    return cached


def prompt_ids(
    tokenizer: Any, task: Any, problem: Any, max_prompt_length: int, template_kwargs: Mapping[str, Any] | None = None
) -> tuple[list[int] | None, int]:
    """(ids, length) of a problem's chat-templated prompt; ids is None when it exceeds `max_prompt_length`.
    `template_kwargs` go to the chat template (model.chat_template_kwargs, e.g. {"enable_thinking": False}).

    A prompt whose text alone needs several times more tokens than the limit (characters / the longest vocabulary
    entry; the factor covers normalisers that merge characters) is not tokenised: a huge data row (megabytes) is
    skipped at once instead of costing seconds at every draw. Its length is then that lower bound."""
    messages = task.messages(problem)
    widest = _max_token_chars(tokenizer)
    if widest:
        chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        if chars // widest > 4 * max_prompt_length:
            return None, chars // widest
    toks = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **dict(template_kwargs or {})
    )
    toks = list(toks["input_ids"] if isinstance(toks, dict) else toks)
    return (toks if len(toks) <= max_prompt_length else None), len(toks)


def prompt_batch(
    tokenizer: Any,
    task: Any,
    problems: Sequence[Any],
    max_prompt_length: int,
    metrics: dict[str, Any],
    template_kwargs: Mapping[str, Any] | None = None,
) -> Batch:
    """Chat-templated prompt ids (`template_kwargs`: prompt_ids'); `metrics["data/skipped_long_prompts"]` counts the
    prompts skipped."""
    if not problems:
        raise ValueError("no problems to build prompts from")
    ids, kept, shortest = [], [], None
    for p in problems:
        toks, length = prompt_ids(tokenizer, task, p, max_prompt_length, template_kwargs)
        shortest = length if shortest is None else min(shortest, length)
        if toks is not None:
            ids.append(toks)
            kept.append(p)
    metrics["data/skipped_long_prompts"] = len(problems) - len(kept)
    if not kept:
        raise PromptsTooLong(
            f"every prompt exceeds model.max_prompt_length={max_prompt_length} (shortest: {shortest} "
            "tokens): raise model.max_prompt_length"
        )
    return Batch(fields={"prompt_ids": ids, **problem_fields(kept)})


#: The per-row fields a problem contributes to a batch (besides its prompt ids).
PROBLEM_FIELDS = ("answer", "problem_id", "prompt_text", "metadata")


def problem_metadata(problem: Any) -> dict[str, Any]:
    """`{**problem.metadata, "domain": problem.domain}` (each part only when the problem has it)."""
    meta = dict(getattr(problem, "metadata", None) or {})
    domain = getattr(problem, "domain", None)
    if domain is not None:
        meta["domain"] = domain
    return meta


def problem_fields(problems: Sequence[Any]) -> dict[str, list[Any]]:
    """The PROBLEM_FIELDS of `problems`, one entry per problem."""
    return {
        "answer": [p.answer for p in problems],
        "problem_id": [p.id for p in problems],
        "prompt_text": [p.prompt for p in problems],
        "metadata": [problem_metadata(p) for p in problems],
    }


def assemble(tokenizer: Any, prompts: Batch, gen: Batch, metrics: dict[str, Any] | None = None) -> Batch:
    """Prompt rows (already repeated per sample) + generation -> the full sequence layout of roll_core.protocol.

    Rows whose prompt alone fills the engine's context (finish reason `prompt_too_long`) are dropped and counted
    in `metrics["data/skipped_context_prompts"]`.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = prompts.union(gen)
    reasons = gen["finish_reason"] if "finish_reason" in gen else ["stop"] * len(gen)
    keep = [i for i, r in enumerate(reasons) if r != "prompt_too_long"]
    if metrics is not None:
        metrics["data/skipped_context_prompts"] = len(reasons) - len(keep)
    if len(keep) < len(reasons):
        longest = max(len(p) for p, r in zip(batch["prompt_ids"], reasons) if r == "prompt_too_long")
        log.warning(
            "%d sample(s) skipped: a prompt of %d tokens fills the inference engine's context; raise the engine's "
            "context (infer_engine.max_model_len) or lower model.max_prompt_length",
            len(reasons) - len(keep),
            longest,
        )
        if not keep:
            raise ValueError(f"every prompt fills the inference engine's context (longest {longest} tokens)")
        batch = batch.index(keep)
    p_ids, p_mask = pad_left(batch["prompt_ids"], pad)
    batch["prompts"] = p_ids
    for k, v in build_sequences(p_ids, p_mask, batch["responses"], batch["response_mask"]).items():
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
    params: SamplingParams,
    template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Accuracy and mean reward of one sample per problem (sampled with `params`; temperature 0 is greedy); with
    several domains (a multi-domain task) also `by_domain`: {domain: {"accuracy", "reward", "n"}}."""
    metrics: dict[str, Any] = {}
    prompts = prompt_batch(tokenizer, task, problems, max_prompt_length, metrics, template_kwargs)
    gen = infer.generate(prompts, params, n=1)
    batch = assemble(tokenizer, prompts, gen)
    scored = reward.score(batch)
    out: dict[str, Any] = {
        "accuracy": float(scored["correct"].mean()),
        "reward": float(scored["scores"].mean()),
        "n": len(prompts),
    }
    domains = [m.get("domain") for m in batch["metadata"]] if "metadata" in batch else []
    if len(set(domains)) > 1 or len(getattr(task, "domains", ())) > 1:
        out["by_domain"] = {}
        for d in dict.fromkeys(domains):
            idx = [i for i, x in enumerate(domains) if x == d]
            out["by_domain"][str(d)] = {
                "accuracy": float(scored["correct"][idx].mean()),
                "reward": float(scored["scores"][idx].mean()),
                "n": len(idx),
            }
    return out
