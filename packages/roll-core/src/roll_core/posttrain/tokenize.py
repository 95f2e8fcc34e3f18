"""SFT rows to token rows: a prompt, a response region and its loss mask, as a sampled trajectory would hold them.

Row forms (`detect_format` picks one per file from its columns, or `data.format` names it):
- `messages`: `{"messages": [{"role", "content"}, ...]}` (optional `tools` column: a list of tool schemas, or that
  list as JSON text; an assistant message's `tool_calls` likewise, each call naming its function). Every assistant
  message is trained unless it has `"train": false` or OpenAI's `"weight": 0` (a `train` that is not true, false or
  null, or a `weight` that is not 0 or 1, is a `wrong_type` skip); system / user / tool messages are context.
  ShareGPT rows alike (LLaMA-Factory's `sharegpt` format): a `conversations` column (when the row has no
  `messages`) of `{"from", "value"}` messages, read by roll_core.posttrain.row_values (human / gpt / system /
  function_call / observation; another `from` is an `unknown_role` skip), with its `system` and `tools` columns.
  What a row's values may hold (and each skip they give) is row_values' contract; this module tokenises them.
- `prompt_completion`: `{"prompt": str | messages, "completion": str | messages}` (TRL's standard and
  conversational forms). Text with `data.chat_template=true` becomes a user message and an assistant message;
  with false, the prompt's ids (the tokenizer's leading special tokens added, e.g. bos, unless the text already
  starts with them; none after it) then the completion's ids (`encode_after` the prompt) and eos (unless the text
  already ends with it).
  Message lists always go through the chat template; only the completion's assistant messages are trained.
- `tokens`: `{"prompt_ids": [...], "response_ids": [...], "response_mask"?: [...]}` (rollout-only output): no
  re-tokenisation; the ids must be in the vocabulary. A row whose `finish_reason` is "length" (its generation was
  cut at the rollout's length limit: no end-of-turn token) is a truncated response like one cut here (counted;
  a `response_too_long` skip with `data.truncate=false`).

Chat layout (roll_core.posttrain.chat_encoder, `ChatEncoder`): the same an agentic RL trajectory has, so SFT
trains exactly what sampling produces; mask 1 covers exactly the trained assistant turns and their end-of-turn
tokens, and a turn or prompt the template does not render as the row gives it is a counted skip (each skip is
named there). Blank text of a prompt, completion or preference response is skipped (`empty`) too, and so is an
SFT / distillation row's trained assistant turn with nothing after its `</think>` and no tool call (Qwen3's empty
think block `<think>\\n\\n</think>\\n\\n` given as the text, or reasoning without an answer): trained, the model
learns to end its turn after thinking, without answering (preference rows keep such a response: a rejected one
is a lesson to unlearn). A text completion without the template (`data.chat_template=false`) is checked alike:
nothing after its first `</think>` (a later whole think block aside) but the eos token's text is an `empty` skip.

Ids after a context (`encode_after`): text is tokenised together with the text before it and the context's own ids
are taken off, when they are a prefix of the whole's (else, where BPE merges across the boundary, on its own: the ids
a model samples after the context's ids). Encoded on its own, a SentencePiece tokenizer prefixes a space to every
piece ("▁" before " It is 4": a token the text does not have, that the model would learn to emit first).

Length: a prompt longer than `max_prompt_length` is skipped (`prompt_too_long`); a response region longer than
`max_response_length` is cut (`TokenRow.truncated`), or skipped (`response_too_long`) when `data.truncate=false`.

`tokenizer_fingerprint(tokenizer)` hashes what decides token ids (the vocabulary, the tokenisation model's merges
and settings, the added and special tokens, the chat template, and the ids of probe texts for the normalizer,
pre-tokenizer and post-processor), not how a library version serialises them, so a teacher's and a student's
tokenizers can be compared by a string, and a file stamped with it stays valid across library upgrades.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll_core.agentic.chat import encode_after
from roll_core.errors import ConfigError
from roll_core.near_duplicates import loose_text
from roll_core.posttrain._fingerprint import FINGERPRINT_PROBES, legacy_tokenizer_fingerprint, tokenizer_fingerprint
from roll_core.posttrain.chat_encoder import ChatEncoder
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.row_values import (
    SHAREGPT_COLUMN,
    blank,
    check_ids,
    check_messages,
    check_text,
    check_tools,
    messages_column,
    need,
    other_roles,
    renamed_roles,
    row_messages,
    tool_call_names,
    train_flag,
)
from roll_core.posttrain.rows import RawRow, SkipRow

# The fingerprint and the row value checks live in sibling modules (this one's size) and stay part of this module's
# API (row_values: what a row's columns may hold; this module: how they become ids).
__all__ = [
    "FINGERPRINT_PROBES",
    "SFT_FORMATS",
    "ChatEncoder",
    "SFTTokenizer",
    "TokenRow",
    "blank",
    "check_ids",
    "check_messages",
    "check_text",
    "check_tools",
    "detect_format",
    "legacy_tokenizer_fingerprint",
    "loose_prompt_keys",
    "need",
    "row_format",
    "tokenizer_fingerprint",
    "tool_call_names",
    "train_flag",
]

log = logging.getLogger(__name__)

SFT_FORMATS = ("messages", "prompt_completion", "tokens")
#: Token rows' column saying why a sampled response ended (rollout-only output: stop | length).
FINISH_REASON = "finish_reason"


@dataclass
class TokenRow:
    """One tokenised example: `prompt_ids`, `response_ids` and the 0/1 loss `mask` over them, where it came from,
    `key` (its prompt ids exactly: pairing, and the hash that decides its held-out side; `loose_prompt_keys` says
    which prompts are one problem but for whitespace), `aligned` sequences (first dimension: one item per
    response token, e.g. a teacher's top-k as an (R, K) tensor) that are cut with the response, `truncated`
    (the length limit cut its response), `other_roles` (its messages' roles that roll does not know:
    row_values' `other_roles`, rendered as context; counted by the loader) and `renamed_roles` (the role aliases
    its messages were read through, "human->user": row_values' `renamed_roles`; counted by the loader)."""

    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int]
    where: str = ""
    key: str = ""
    aligned: dict[str, list[Any]] = field(default_factory=dict)
    truncated: bool = False
    other_roles: tuple[str, ...] = ()
    renamed_roles: tuple[str, ...] = ()


def loose_prompt_keys(tokenizer: Any, prompts: Sequence[Sequence[int]]) -> list[str]:
    """A near-duplicate key per prompt (token ids): prompts with equal keys are one problem to a model but for
    whitespace ("Q?" and "Q?\\n", a doubled space), as the RL tasks' held-out split sees them
    (roll_core.near_duplicates). Each run of text between the tokenizer's special and added tokens (ChatML's
    `<|im_start|>`, Llama 3's headers: where a template puts the message) is decoded and whitespace-collapsed
    (`loose_text`), so whitespace at a message's ends is gone too; the tokens themselves are kept by id.

    Why not `TokenRow.key` (the exact ids): "Q?" and "Q?\\n" tokenise to other ids, so they were counted as
    distinct prompts and could fall on both sides of a held-out split."""
    marks = set(getattr(tokenizer, "all_special_ids", None) or ()) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    runs: list[list[int]] = []  # every prompt's text runs, decoded in one call (a fast tokenizer batches them)
    shapes: list[list[int | None]] = []  # per prompt: a mark's id, or None for the next text run
    for ids in prompts:
        shape: list[int | None] = [None]
        runs.append([])
        for t in ids:
            t = int(t)
            if t in marks:
                shape += [t, None]
                runs.append([])
            else:
                runs[-1].append(t)
        shapes.append(shape)
    texts = iter(tokenizer.batch_decode(runs, clean_up_tokenization_spaces=False) if runs else [])
    # JSON of [text, id, text, ...]: a mark and a text that spells its id stay apart
    return [json.dumps([loose_text(next(texts)) if p is None else p for p in shape]) for shape in shapes]


# ---- format detection -------------------------------------------------------------------------------------------
def row_format(row: Mapping[str, Any], cfg: DataConfig) -> str | None:
    """The form a row's columns spell (None when none): preference and rollout before the SFT forms, since a
    rollout row has prompt_ids and response_ids too."""
    if cfg.chosen_key in row and cfg.rejected_key in row:
        return "preference"
    if cfg.prompt_ids_key in row and cfg.response_ids_key in row:
        return "rollout" if (cfg.reward_key in row or cfg.correct_key in row) else "tokens"
    if cfg.messages_key in row or SHAREGPT_COLUMN in row:
        return "messages"
    if cfg.prompt_key in row and cfg.completion_key in row:
        return "prompt_completion"
    return None


def detect_format(rows: Sequence[RawRow], cfg: DataConfig, allowed: Sequence[str], setting: str) -> str:
    """The form of one file's rows: `data.format` when set, else the most common form among its first 100 rows
    (a few bad rows do not decide it). A ConfigError naming the columns when no row has an allowed form."""
    if cfg.format != "auto":
        if cfg.format not in allowed:
            raise ConfigError(f"data.format={cfg.format!r} cannot feed this pipeline; it reads {', '.join(allowed)}")
        return cfg.format
    votes: dict[str, int] = {}
    for raw in rows[:100]:
        form = row_format(raw.row, cfg)
        if form == "rollout" and "rollout" not in allowed and "tokens" in allowed:
            form = "tokens"  # rollout-only output is also SFT / distillation token rows
        if form in allowed:
            votes[form] = votes.get(form, 0) + 1
    if not votes:
        keys = sorted({k for r in rows[:100] for k in r.row})[:20]
        raise ConfigError(
            f"{setting}: cannot tell the row form of {rows[0].file if rows else 'the file'} from its columns "
            f"{keys}; expected one of {', '.join(allowed)} (set data.format, or the data.*_key column names)"
        )
    return max(votes, key=lambda f: votes[f])


# ---- SFT rows ---------------------------------------------------------------------------------------------------
def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _leading_specials(with_specials: list[int], text_ids: list[int]) -> list[int] | None:
    """The ids a tokenizer puts before a text's ids when it adds its special tokens (bos): those before the text's
    ids inside the ids with special tokens (None when they are not there whole)."""
    n = len(text_ids)
    for start in range(len(with_specials) - n + 1):
        if with_specials[start : start + n] == text_ids:
            return with_specials[:start]
    return None


def _no_answer(text: str, end: str | None = None) -> bool:
    """Whether `text` reasons and then says nothing: blank after its reasoning (and `end`, the eos token's text a
    raw completion may close with). Text without `</think>` is left to the blank checks: a `<think>` alone may be
    a word of an answer. The reasoning ends at the first `</think>` (where a model's own reasoning ends); the
    answer is what follows it less any later whole `<think>...</think>` block: an answer that spells the tag
    ("It is </think>") is an answer (read after the last `</think>`, it was an `empty` skip)."""
    if "</think>" not in text:
        return False
    after = text.partition("</think>")[2]
    while (at := after.find("<think>")) >= 0 and (close := after.find("</think>", at)) >= 0:
        after = after[:at] + after[close + len("</think>") :]
    after = after.strip()
    return not (after.removesuffix(end).strip() if end else after)


def _check_answers(messages: list[dict[str, Any]], trained: list[bool]) -> None:
    """An `empty` skip for a trained assistant turn that reasons and then says nothing (`_no_answer`) and makes no
    tool call (see the module doc)."""
    for i, (m, train) in enumerate(zip(messages, trained, strict=True)):
        content = m.get("content")
        if m["role"] != "assistant" or not train or m.get("tool_calls") or not isinstance(content, str):
            continue
        if _no_answer(content):
            raise SkipRow(
                "empty",
                f"assistant message {i} to train has nothing after its </think> (no answer, no tool call): "
                f"{content[-60:]!r}",
            )


class SFTTokenizer:
    """SFT (and distillation) rows of one form to `TokenRow`s, with the length limits applied."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, *, max_prompt_length: int, max_response_length: int) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg
        self.max_prompt, self.max_response = max_prompt_length, max_response_length
        self.vocab = len(tokenizer)
        self._chat: ChatEncoder | None = None

    @property
    def chat(self) -> ChatEncoder:
        if self._chat is None:
            self._chat = ChatEncoder(self.tokenizer, self.cfg.chat_template_kwargs)
        return self._chat

    def parse(self, raw: RawRow, form: str) -> TokenRow:
        """One row of form `form` to a TokenRow within the length limits (SkipRow otherwise)."""
        row = self.tokens(raw.row, form)
        row.where = raw.where
        return self.limit(row)

    def tokens(self, row: Mapping[str, Any], form: str) -> TokenRow:
        """The row's ids and mask before length limits."""
        cfg = self.cfg
        if form == "tokens":
            prompt = check_ids(need(row, cfg.prompt_ids_key), cfg.prompt_ids_key, self.vocab)
            response = check_ids(need(row, cfg.response_ids_key), cfg.response_ids_key, self.vocab)
            mask = [1] * len(response)
            if row.get(cfg.response_mask_key) is not None:
                mask = row[cfg.response_mask_key]
                bits = isinstance(mask, (list, tuple)) and all(
                    isinstance(m, (int, float)) and m in (0, 1) for m in mask
                )
                if not bits or len(mask) != len(response):  # nested lists too (a set of them raised TypeError)
                    raise SkipRow(
                        "bad_mask", f"{cfg.response_mask_key!r} must be 0/1, one per response id ({len(response)})"
                    )
                mask = [int(m) for m in mask]
            # rollout-only's finish_reason "length": the rollout's length limit cut this response (no end-of-turn
            # token), as max_response_length cuts one here; it was trained as a finished answer, uncounted, even
            # with data.truncate=false
            cut = row.get(FINISH_REASON) == "length"
            return TokenRow(prompt, response, mask, key=json.dumps(prompt), truncated=cut)
        if form == "messages":
            messages = row_messages(row, cfg.messages_key)
            trained = [train_flag(m) for m in messages]
            _check_answers(messages, trained)
            renamed = renamed_roles(row[messages_column(row, cfg.messages_key)])
            return self.chat_row(messages, trained, row.get("tools"), renamed=renamed)
        if form == "prompt_completion":
            prompt, completion = need(row, cfg.prompt_key), need(row, cfg.completion_key)
            if isinstance(prompt, str) and isinstance(completion, str) and not cfg.chat_template:
                prompt, completion = check_text(prompt, cfg.prompt_key), check_text(completion, cfg.completion_key)
                if _no_answer(completion, self.tokenizer.eos_token):  # as a templated turn (preference rows keep it)
                    why = f"{cfg.completion_key!r} has nothing after its </think> (no answer): {completion[-60:]!r}"
                    raise SkipRow("empty", why)
                return self.raw_text(prompt, completion)
            p = self.as_messages(prompt, cfg.prompt_key, "user")
            c = self.as_messages(completion, cfg.completion_key, "assistant")
            trained = [False] * len(p) + [train_flag(m) for m in c]
            _check_answers(p + c, trained)
            return self.chat_row(p + c, trained, row.get("tools"), renamed=renamed_roles(prompt, completion))
        raise ValueError(f"not an SFT row form: {form!r} (one of {', '.join(SFT_FORMATS)})")

    def as_messages(self, value: Any, key: str, role: str) -> list[dict[str, Any]]:
        """Text as one message of `role`, or a message list checked."""
        if isinstance(value, str):
            return [{"role": role, "content": check_text(value, key)}]
        return check_messages(value, key)

    def chat_row(
        self, messages: list[dict[str, Any]], trained: list[bool], tools: Any, *, renamed: tuple[str, ...] = ()
    ) -> TokenRow:
        """A conversation through the chat template (`trained[i]`: assistant message i is trained); `renamed`: the
        role aliases the row's messages were read through (`TokenRow.renamed_roles`)."""
        prompt, response, mask = self.chat.encode(messages, trained, check_tools(tools))
        roles = other_roles(messages)
        return TokenRow(prompt, response, mask, key=json.dumps(prompt), other_roles=roles, renamed_roles=renamed)

    def raw_text(self, prompt: str, completion: str) -> TokenRow:
        """Text without a template: the tokenizer's leading special tokens (bos) and the prompt's ids, then the
        completion's ids as they follow the prompt, then eos (see the module doc)."""
        tok = self.tokenizer
        if tok.eos_token_id is None:
            raise ConfigError("data.chat_template=false needs a tokenizer with an eos token to end each completion")
        eos = int(tok.eos_token_id)
        text_ids = _encode(tok, prompt)
        with_specials = list(tok(prompt, add_special_tokens=True)["input_ids"])
        lead = _leading_specials(with_specials, text_ids)
        if lead is None:  # a post-processor that rewrites the text's ids: take what it gives
            prompt_ids = with_specials
        else:
            if text_ids[: len(lead)] == lead:
                lead = []  # text pre-rendered with its bos: a second one is input the model never saw in training
            # only the leading ones: a post-processor that appends eos (add_eos_token) ended the prompt with eos
            prompt_ids = [*lead, *text_ids]
        response = encode_after(tok, prompt, completion)
        if not response or response[-1] != eos:  # a completion whose text ends with eos is not ended twice
            response.append(eos)
        return TokenRow(prompt_ids, response, [1] * len(response), key=json.dumps(prompt_ids))

    def limit(self, row: TokenRow) -> TokenRow:
        """The length limits: a long prompt is skipped, a long response cut (counted) or skipped."""
        if len(row.prompt_ids) > self.max_prompt:
            raise SkipRow(
                "prompt_too_long", f"{len(row.prompt_ids)} prompt tokens > max_prompt_length={self.max_prompt}"
            )
        if not row.prompt_ids:
            raise SkipRow("empty", "the prompt has no tokens (the first response token would have no context)")
        if row.truncated and not self.cfg.truncate:  # a token row its rollout cut (finish_reason=length)
            raise SkipRow(
                "response_too_long",
                f"the rollout cut this response at its length limit ({FINISH_REASON}=length; data.truncate=false)",
            )
        if len(row.response_ids) > self.max_response:
            if not self.cfg.truncate:
                raise SkipRow(
                    "response_too_long",
                    f"{len(row.response_ids)} response tokens > max_response_length={self.max_response} "
                    "(data.truncate=false)",
                )
            n = self.max_response
            row.response_ids, row.mask = row.response_ids[:n], row.mask[:n]
            row.aligned = {k: v[:n] for k, v in row.aligned.items()}
            row.truncated = True  # counted by the RowSource that keeps it (a row skipped after its cut is not)
        if not any(row.mask):
            raise SkipRow("no_trained_tokens", "no response token has loss mask 1")
        return row
