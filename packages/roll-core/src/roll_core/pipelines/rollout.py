"""Rollout helpers shared by the RLVR pipeline and `roll-eval`: prompt batches, sequence assembly, evaluation.

A prompt batch holds the chat-templated token ids of each problem (`prompt_ids`), its ground truth (`answer`),
id (`problem_id`), prompt text (`prompt_text`, the user message), metadata (`metadata`: the problem's
`metadata` with its `domain`), which reach rewards that declare them, and the chat messages the policy's prompt was
rendered from (`prompt_messages`: system prompt, examples, a chat row's earlier turns, the user message), which a
reward model's chat template renders (roll_core.cluster.reward_model). Prompts longer than the limit are skipped
and counted, never truncated (a truncated question has a different answer). An engine context
(infer_engine.max_model_len) that cannot hold the chat template plus one generated token is a ConfigError before
any rollout (`check_context`); a batch whose every prompt fills the engine's context, `PromptsFillContext`.

Pictures (vision-language models, roll_core.multimodal): with a `VisionProcessor` (`vision_processor(model path,
tokenizer, model config)`: None for a text model; the config's picture size bounds apply) a problem's `images`
are placed at the `<image>` markers of its user messages, in order (a chat row's earlier turns included), or first
in its last user message, and the prompt is encoded by the processor:
`prompt_ids` hold the expanded picture tokens (model.max_prompt_length counts them) and the batch gets the per-row
field `mm_inputs` (an `MMInputs`, or None for a row without pictures), which `generate` hands to the inference
engines and `assemble` carries into the training batch. A row whose pictures cannot be read or placed is skipped
and counted (`data/skipped_bad_images`), never sent half-built; a problem with pictures given to a text model is
an error naming model.path and the problem (`check_pictures`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from roll_core.errors import ConfigError
from roll_core.eval_history import SKIPPED
from roll_core.eval_metrics import UNKNOWN, counted_correct, failure, is_grade, std_error
from roll_core.interfaces import SamplingParams
from roll_core.protocol import Batch, build_sequences, pad_left

log = logging.getLogger(__name__)


class PromptsTooLong(ConfigError):
    """Every prompt of a batch was skipped: longer than model.max_prompt_length (or pictures unreadable). A config
    error where it ends a run (roll-train: one line, exit 2): raise model.max_prompt_length (or, for prompts with
    pictures, lower model.image_max_pixels)."""


class PromptsFillContext(ConfigError):
    """Every prompt of a batch fills the inference engine's context (infer_engine.max_model_len), so nothing can be
    generated. A config error where it ends a run (roll-train: one line, exit 2); a ValueError, as before, for the
    callers that count such a batch as skipped (the rollout-only shard)."""


class BadPictures(ValueError):
    """A problem's pictures cannot be read, or do not match its prompt's `<image>` markers (a counted skip)."""


def vision_processor(model_path: str, tokenizer: Any = None, model: Any = None) -> Any:
    """The `VisionProcessor` of a vision-language model folder (its tokenizer: `tokenizer` when given), None for a
    text model. `model` (the run's ModelConfig) gives the picture size bounds (model.image_min_pixels /
    image_max_pixels); bounds that cannot apply (a text model, a fixed-size family, min above max) are a
    ConfigError."""
    from roll_core.multimodal import VisionProcessor, engine_pixels, image_pixels, is_vision_model

    engine_pixels(model, model_path)  # (a ConfigError for bounds given to a text model)
    if not is_vision_model(model_path):
        return None
    pixels = image_pixels(model)
    try:
        return VisionProcessor(model_path, tokenizer, **pixels)
    except ValueError as exc:
        if not any(v is not None for v in pixels.values()):
            raise
        raise ConfigError(str(exc)) from None


def check_pictures(processor: Any, problems: Sequence[Any], model_path: str) -> None:
    """ConfigError when a problem has pictures but the model is a text model (processor None)."""
    if processor is not None:
        return
    for p in problems:
        n = len(getattr(p, "images", None) or ())
        if n:
            from roll_core.errors import ConfigError

            raise ConfigError(
                f"problem {p.id} has {n} picture(s) but model.path={model_path} is a text model (not a "
                "vision-language family roll feeds pictures to: roll_core.multimodal.FAMILIES): use a "
                "vision-language model, or data without an images column"
            )


def check_context(max_model_len: int | None, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> None:
    """ConfigError when `infer_engine.max_model_len` cannot hold any prompt, before any rollout: the chat template
    of an empty user message is the shortest prompt a task can give (a task's own messages only add to it), and an
    engine refuses a prompt that leaves no room for one generated token. Left to the engines when the tokenizer
    has no usable chat template (the prompts then fail to encode with their own error)."""
    if max_model_len is None:
        return
    try:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": ""}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **dict(template_kwargs or {}),
        )
    except Exception:  # no template, or one that needs more than a user message: nothing known to compare
        return
    least = len(ids["input_ids"] if isinstance(ids, dict) else ids)
    if max_model_len <= least:
        raise ConfigError(
            f"infer_engine.max_model_len={max_model_len} holds no prompt: the chat template alone takes {least} "
            f"tokens (an empty user message) and a prompt needs room for a generated token; raise "
            f"infer_engine.max_model_len (prompt + response tokens) above model.max_prompt_length + "
            "model.max_response_length, or leave it null (the model's context)"
        )


def _vision_messages(messages: list[dict[str, Any]], n_images: int) -> list[dict[str, Any]]:
    """The task's messages with the pictures placed: at the `<image>` markers of its user messages, in order across
    them (a chat row's earlier turns may hold some), else first in the last user message (the problem's prompt).
    BadPictures when the markers' count is not the pictures', or a marker stands in another role's message (only
    the last user message's markers were counted once: an earlier turn's stayed literal text, which for LLaVA is
    its picture token)."""
    from roll_core.multimodal import IMAGE_MARKER, as_content

    out = [dict(m) for m in messages]
    users = [i for i, m in enumerate(out) if m.get("role") == "user"]
    if not users:
        raise BadPictures("the task's messages have no user message to put the pictures in")
    markers = [m["content"].count(IMAGE_MARKER) if isinstance(m.get("content"), str) else 0 for m in out]
    for i, m in enumerate(out):
        if markers[i] and m.get("role") != "user":
            raise BadPictures(f"message {i} ({m.get('role')}) has an {IMAGE_MARKER} marker: pictures go in user turns")
    if sum(markers) not in (0, n_images):
        raise BadPictures(f"the prompt has {sum(markers)} {IMAGE_MARKER} marker(s) but {n_images} picture(s)")
    try:
        if not sum(markers):
            out[users[-1]]["content"] = as_content(out[users[-1]]["content"], n_images)
        for i in users:
            if markers[i]:
                out[i]["content"] = as_content(out[i]["content"], markers[i])
    except ValueError as exc:
        raise BadPictures(str(exc)) from None
    return out


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
    """(ids, length) of a text problem's chat-templated prompt (`encode_prompt` without pictures)."""
    ids, length, _ = encode_prompt(tokenizer, task, problem, max_prompt_length, template_kwargs)
    return ids, length


def encode_prompt(
    tokenizer: Any,
    task: Any,
    problem: Any,
    max_prompt_length: int,
    template_kwargs: Mapping[str, Any] | None = None,
    processor: Any = None,
) -> tuple[list[int] | None, int, Any]:
    """(ids, length, MMInputs | None) of a problem's chat-templated prompt; ids is None when it exceeds
    `max_prompt_length` (picture tokens count). `template_kwargs` go to the chat template
    (model.chat_template_kwargs, e.g. {"enable_thinking": False}); `processor` (a VisionProcessor) encodes the
    prompts of a vision-language model, with the problem's pictures. Raises BadPictures for pictures that cannot
    be read or placed, ValueError for pictures without a processor.

    A prompt whose text alone needs several times more tokens than the limit (characters / the longest vocabulary
    entry; the factor covers normalisers that merge characters) is not tokenised: a huge data row (megabytes) is
    skipped at once instead of costing seconds at every draw. Its length is then that lower bound."""
    messages = task.messages(problem)
    images = list(getattr(problem, "images", None) or ())
    if images and processor is None:
        raise ValueError(
            f"problem {problem.id} has {len(images)} picture(s) but {getattr(tokenizer, 'name_or_path', 'the model')} "
            "is a text model"
        )
    widest = _max_token_chars(tokenizer)
    if widest:
        chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        if chars // widest > 4 * max_prompt_length:
            return None, chars // widest, None
    if processor is not None:
        if images:
            messages = _vision_messages(messages, len(images))
        try:
            toks, mm = processor.encode_messages(messages, images, **dict(template_kwargs or {}))
        except ValueError as exc:  # unreadable picture, placeholder/feature count mismatch: the row is bad
            raise BadPictures(str(exc)) from None
        return (toks if len(toks) <= max_prompt_length else None), len(toks), mm
    toks = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **dict(template_kwargs or {})
    )
    toks = list(toks["input_ids"] if isinstance(toks, dict) else toks)
    return (toks if len(toks) <= max_prompt_length else None), len(toks), None


def prompt_batch(
    tokenizer: Any,
    task: Any,
    problems: Sequence[Any],
    max_prompt_length: int,
    metrics: dict[str, Any],
    template_kwargs: Mapping[str, Any] | None = None,
    processor: Any = None,
) -> Batch:
    """Chat-templated prompt ids (`template_kwargs`, `processor`: encode_prompt's), and with a processor the
    `mm_inputs` field; `metrics["data/skipped_long_prompts"]` counts the prompts skipped for their length,
    `metrics["data/skipped_bad_images"]` those whose pictures could not be read or placed."""
    if not problems:
        raise ValueError("no problems to build prompts from")
    ids, mms, kept, shortest, bad = [], [], [], None, 0
    picture_tokens = 0  # of the shortest prompt (its pictures' placeholders)
    for p in problems:
        try:
            toks, length, mm = encode_prompt(tokenizer, task, p, max_prompt_length, template_kwargs, processor)
        except BadPictures as exc:
            bad += 1
            log.warning("problem %s skipped: its pictures: %s", p.id, exc)
            continue
        if shortest is None or length < shortest:
            shortest, picture_tokens = length, (mm.num_tokens if mm is not None else 0)
        if toks is not None:
            ids.append(toks)
            mms.append(mm)
            kept.append(p)
    metrics["data/skipped_long_prompts"] = len(problems) - len(kept) - bad
    if processor is not None or bad:  # (text runs keep their metric keys)
        metrics["data/skipped_bad_images"] = metrics.get("data/skipped_bad_images", 0) + bad
    if not kept:
        if shortest is None:
            raise PromptsTooLong(f"the pictures of all {bad} prompt(s) could not be read or placed (logged above)")
        why = f" ({bad} more with unreadable pictures)" if bad else ""
        if picture_tokens:  # the pictures' tokens count: smaller pictures are the other way to fit
            raise PromptsTooLong(
                f"every prompt exceeds model.max_prompt_length={max_prompt_length} (shortest: {shortest} tokens, "
                f"{picture_tokens} of them picture tokens){why}: raise model.max_prompt_length, or lower "
                "model.image_max_pixels so each picture takes fewer tokens (a Qwen-VL picture takes its resized "
                "area / 28^2, Qwen3-VL's area / 32^2)"
            )
        raise PromptsTooLong(
            f"every prompt exceeds model.max_prompt_length={max_prompt_length} (shortest: {shortest} "
            f"tokens){why}: raise model.max_prompt_length"
        )
    fields: dict[str, list[Any]] = {"prompt_ids": ids, **problem_fields(kept, task)}
    if processor is not None:
        fields["mm_inputs"] = mms
    return Batch(fields=fields)


#: The per-row fields a problem contributes to a batch (besides its prompt ids).
PROBLEM_FIELDS = ("answer", "problem_id", "prompt_text", "metadata", "prompt_messages")


def problem_metadata(problem: Any) -> dict[str, Any]:
    """`{**problem.metadata, "domain": problem.domain}` (each part only when the problem has it)."""
    meta = dict(getattr(problem, "metadata", None) or {})
    domain = getattr(problem, "domain", None)
    if domain is not None:
        meta["domain"] = domain
    return meta


def problem_fields(problems: Sequence[Any], task: Any = None) -> dict[str, list[Any]]:
    """The PROBLEM_FIELDS of `problems`, one entry per problem; `prompt_messages` (`task.messages(problem)`) only
    with the `task` (without it, `prompt_text` is all a reader has of the prompt)."""
    fields = {
        "answer": [p.answer for p in problems],
        "problem_id": [p.id for p in problems],
        "prompt_text": [p.prompt for p in problems],
        "metadata": [problem_metadata(p) for p in problems],
    }
    if task is not None:
        fields["prompt_messages"] = [task.messages(p) for p in problems]
    return fields


def assemble(tokenizer: Any, prompts: Batch, gen: Batch, metrics: dict[str, Any] | None = None) -> Batch:
    """Prompt rows (already repeated per sample) + generation -> the full sequence layout of roll_core.protocol.

    Rows whose prompt alone fills the engine's context (finish reason `prompt_too_long`) are dropped;
    `metrics["data/skipped_context_prompts"]` counts their prompts (a run of consecutive rows of one prompt, as
    `repeat_interleave` lays a group out, is one prompt). When every row's does: PromptsFillContext (a ConfigError
    naming infer_engine.max_model_len and model.max_prompt_length). A generation with MoE routing (ROUTING_ROWS)
    gets it laid out as `routed_experts`; `metrics["routing/unreplayed_positions"]` and `["routing/unreplayed_rows"]`
    count what the trainer will route itself for want of a record (roll_core.routing.unreplayed).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = prompts.union(gen)
    reasons = gen["finish_reason"] if "finish_reason" in gen else ["stop"] * len(gen)
    keep = [i for i, r in enumerate(reasons) if r != "prompt_too_long"]
    if metrics is not None:
        ids = batch["problem_id"] if "problem_id" in batch else [None] * len(batch)
        key = [(ids[i], tuple(batch["prompt_ids"][i])) for i in range(len(reasons))]
        metrics["data/skipped_context_prompts"] = sum(
            r == "prompt_too_long" and (i == 0 or reasons[i - 1] != r or key[i - 1] != key[i])
            for i, r in enumerate(reasons)
        )
    if len(keep) < len(reasons):
        longest = max(len(p) for p, r in zip(batch["prompt_ids"], reasons) if r == "prompt_too_long")
        log.warning(
            "%d sample(s) skipped: a prompt of %d tokens fills the inference engine's context; raise the engine's "
            "context (infer_engine.max_model_len) or lower model.max_prompt_length",
            len(reasons) - len(keep),
            longest,
        )
        if not keep:  # nothing to generate from: the limits disagree with the data (one line, not a traceback)
            shortest = min(len(p) for p in batch["prompt_ids"])
            raise PromptsFillContext(
                f"every prompt fills the inference engine's context (shortest {shortest} tokens, longest {longest}): "
                "raise infer_engine.max_model_len (prompt + response tokens) above model.max_prompt_length + "
                "model.max_response_length, or lower model.max_prompt_length below it (longer prompts are then "
                "skipped before generation)"
            )
        batch = batch.index(keep)
    cut_picture_tokens(tokenizer, batch, pad, metrics)
    p_ids, p_mask = pad_left(batch["prompt_ids"], pad)
    batch["prompts"] = p_ids
    for k, v in build_sequences(p_ids, p_mask, batch["responses"], batch["response_mask"]).items():
        batch[k] = v
    from roll_core.routing import ROUTED_EXPERTS, ROUTING_ROWS, routing_layout, unreplayed

    if ROUTING_ROWS in batch:  # the engine's MoE routing, aligned with input_ids (routed-expert replay)
        lens = [len(p) for p in batch["prompt_ids"]]
        batch[ROUTED_EXPERTS] = routing_layout(batch[ROUTING_ROWS], lens, p_ids.shape[1], batch["responses"].shape[1])
        # positions with no record fall back to the trainer's own router: counted, not silent
        positions, rows = unreplayed(batch[ROUTED_EXPERTS], batch["attention_mask"])
        if metrics is not None:
            metrics["routing/unreplayed_positions"], metrics["routing/unreplayed_rows"] = positions, rows
        if rows:
            log.warning("%d row(s) have no recorded MoE routing: the trainer routes them itself (no replay)", rows)
    return batch


def picture_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the picture placeholder and vision marker tokens `tokenizer` has (every supported family's)."""
    from roll_core.multimodal import FAMILIES

    unk = getattr(tokenizer, "unk_token_id", None)
    names = {f.image_token for f in FAMILIES.values()} | {"<|video_pad|>", "<|vision_start|>", "<|vision_end|>"}
    return {i for i in (tokenizer.convert_tokens_to_ids(n) for n in sorted(names)) if isinstance(i, int) and i != unk}


def cut_picture_tokens(tokenizer: Any, batch: Batch, pad: int, metrics: dict[str, Any] | None = None) -> None:
    """A vision-language batch's responses end before any picture placeholder the policy sampled itself.

    Such a token has no picture behind it: the trainer could not match it to features, and re-feeding it would
    change what it means. Its response is cut before it (the tokens after it are masked and set to `pad`), as an
    agentic turn is; the reward sees the text before the cut. `metrics["data/picture_token_cuts"]` counts the rows.
    Text batches (no `mm_inputs` field) are left as they are.
    """
    if "mm_inputs" not in batch or "responses" not in batch:
        return
    ids = picture_token_ids(tokenizer)
    if not ids:
        return
    resp, mask = batch["responses"], batch["response_mask"]
    hit = torch.isin(resp, torch.tensor(sorted(ids), dtype=resp.dtype)) & mask.bool()
    rows = hit.any(dim=1)
    if metrics is not None:
        metrics["data/picture_token_cuts"] = int(rows.sum())
    if not bool(rows.any()):
        return
    after = hit.long().cumsum(dim=1) > 0  # the first sampled placeholder and everything after it
    resp, mask = resp.masked_fill(after, pad), mask.masked_fill(after, 0)
    batch["responses"], batch["response_mask"] = resp, mask
    log.warning("%d response(s) sampled a picture placeholder token and were cut before it", int(rows.sum()))


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
    processor: Any = None,
) -> dict[str, float]:
    """Accuracy (with `accuracy_stderr`, its standard error over the problems: eval_metrics.std_error, as roll-eval's)
    and mean reward of one sample per problem (sampled with `params`; temperature 0 is greedy); with several domains
    (a multi-domain task) also `by_domain`: {domain: {"accuracy", "accuracy_stderr", "reward", "n"}}, rows without
    a domain under eval_metrics.UNKNOWN.

    Counted as roll-eval counts them (roll_core.eval_metrics `failure` and `counted_correct`), so that roll-eval of
    the same model with --n 1 gives the same accuracy: a row the engine left "abort" (refused after
    pipeline.max_idle_aborts idle aborts by an `infer` that resumes, as the prompts collector's does; never
    finished otherwise) and a row the reward failed on (`reward_failed`: its NaN score replaced, its grade kept)
    are wrong whatever their `correct` says; their scores still count in the reward. A graded row whose `correct`
    is no grade (not 0 or 1: partial credit 0.5, NaN; eval_metrics.is_grade) is such a failed row too, as the
    reward guard in front of the reward role makes it (reward_guard: failed, its `correct` 0), so a scoring that
    bypassed the guard gives the same accuracy, never one raised by a fraction: `invalid_correct` counts them (a
    warning says so). `n` (the run's `eval/n`) is
    the problems scored: those whose prompt exceeds `max_prompt_length` (`skipped_long`) or fills the engine's
    context (`skipped_context`, dropped by `assemble`) are not in it, nor in the accuracy, nor those whose pictures
    could not be read (`skipped_bad_images`, given where the prompts have pictures or some were unreadable)."""
    metrics: dict[str, Any] = {}
    prompts = prompt_batch(tokenizer, task, problems, max_prompt_length, metrics, template_kwargs, processor)
    gen = infer.generate(prompts, params, n=1)
    batch = assemble(tokenizer, prompts, gen, metrics)
    scored = reward.score(batch)
    reasons = batch["finish_reason"] if "finish_reason" in batch else ["stop"] * len(batch)
    unscored = scored["reward_failed"].tolist() if "reward_failed" in scored else [False] * len(batch)
    counted, invalid = [], 0
    for c, why, bad in zip(scored["correct"].tolist(), reasons, unscored, strict=True):
        failed = failure(why == "abort", bool(bad))
        if failed is None and not is_grade(c):  # no grade: a failed row, as the reward guard flags it
            failed, invalid = failure(False, True), invalid + 1
        counted.append(counted_correct({"correct": c, "failed": failed}))
    if invalid:
        log.warning(
            "evaluation: %d of %d rows have a correct that is not 0 or 1 (the reward's grade must be 0/1): counted "
            "as failed rows (wrong)",
            invalid,
            len(counted),
        )
    correct = torch.tensor(counted)
    out: dict[str, Any] = {
        "accuracy": float(correct.mean()),
        # over problems, as roll-eval's (one sample each here); None for fewer than two problems
        "accuracy_stderr": std_error(correct.tolist()),
        "reward": float(scored["scores"].mean()),
        "n": len(batch),  # one row per scored problem
        "invalid_correct": invalid,  # graded rows whose correct was no grade: counted as failed (docstring)
        "skipped_long": int(metrics.get("data/skipped_long_prompts", 0)),
        "skipped_context": int(metrics.get("data/skipped_context_prompts", 0)),
    }
    if "data/skipped_bad_images" in metrics:  # (a text run's evaluation keeps its keys, as its training does)
        out["skipped_bad_images"] = int(metrics["data/skipped_bad_images"])
    # A row without a domain is grouped as roll-eval groups it (eval_metrics.breakdown: UNKNOWN), so that both
    # name its metrics `eval/unknown/...` (the training's were `eval/None/...`).
    domains = [m.get("domain") for m in batch["metadata"]] if "metadata" in batch else []
    domains = [UNKNOWN if d is None else str(d) for d in domains]
    if len(set(domains)) > 1 or len(getattr(task, "domains", ())) > 1:
        out["by_domain"] = {}
        for d in dict.fromkeys(domains):
            idx = [i for i, x in enumerate(domains) if x == d]
            out["by_domain"][d] = {
                "accuracy": float(correct[idx].mean()),
                "accuracy_stderr": std_error(correct[idx].tolist()),
                "reward": float(scored["scores"][idx].mean()),
                "n": len(idx),
            }
    return out


def eval_log(res: dict[str, Any]) -> dict[str, Any]:
    """The step metrics of an `evaluate` result, as every pipeline logs them: `eval/accuracy` with its standard error
    over the problems (`eval/accuracy_stderr`, report.md's `± se`), `eval/reward`, `eval/n`, the held-out problems
    skipped unscored under the training's names (`eval/skipped_long_prompts`, `eval/skipped_context_prompts`,
    `eval/skipped_bad_images`: roll_core.eval_history.SKIPPED), and per domain `eval/<d>/accuracy`,
    `accuracy_stderr`, `reward`, `n`."""
    out: dict[str, Any] = {
        "eval/accuracy": res["accuracy"],
        "eval/accuracy_stderr": res.get("accuracy_stderr"),
        "eval/reward": res["reward"],
        "eval/n": float(res["n"]),
    }
    # eval/n alone read 6 for 8 held-out problems, 2 of them skipped, as for a held-out set of 6 (report.md too)
    out.update({name: float(res[key]) for key, name in SKIPPED.items() if key in res})
    for d, m in res.get("by_domain", {}).items():
        for key in ("accuracy", "accuracy_stderr", "reward", "n"):
            out[f"eval/{d}/{key}"] = m.get(key)
    return out
