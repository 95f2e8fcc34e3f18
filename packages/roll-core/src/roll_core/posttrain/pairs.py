"""Preference pairs: from `{prompt, chosen, rejected}` rows, or built from a rollout-only output file.

Preference rows (TRL's forms): `prompt` text or messages with `chosen` / `rejected` text or messages (explicit
prompt), or no prompt and `chosen` / `rejected` message lists sharing their first messages (implicit prompt: the
longest common prefix of the two lists, which must end on a non-assistant message, a counted
`prompt_ends_on_assistant` skip otherwise, and be followed on both sides by an assistant message, the answers, a
counted `prompt_not_shared` skip otherwise: the two would answer different prompts). Lists that already hold the
prompt are read as the implicit form, the `prompt` column aside (it would otherwise be rendered twice): beside a
text prompt, lists that start with a non-assistant message (HuggingFaceH4/ultrafeedback_binarized's layout, as
TRL's `maybe_extract_prompt` reads it), one of whose messages before the answer holds the prompt's text (else a
counted `prompt_not_in_conversation` skip: read as a conversation the row would lose its prompt); beside a
message-list prompt, lists that start with its messages (same roles and contents). Text prompt and responses follow
`data.chat_template` like SFT's prompt/completion rows, when all three are text: a message-list side puts both
through the template. Sides whose messages before their answers differ (a system prompt in one only) are a counted
`prompt_not_shared` skip naming the difference (they were `prompt_mismatch` or `no_prompt`); so are multi-turn
sides that share an answer and first differ at a later user turn or tool result (their later answers reply to
different messages, as in an implicit prompt ending on an assistant message). Message lists in
ShareGPT's form (`{"from", "value"}`) are read as the SFT rows' are (roll_core.posttrain.row_values), also where
they are compared with the prompt (a text prompt inside ShareGPT conversations was a `prompt_not_in_conversation`
skip; a message-list prompt was rendered a second time before them).
Text sides without a prompt column are a counted `no_prompt` skip naming the column (they were `wrong_type`,
"must be a list of messages"): TRL's implicit-prompt text form (a shared text prefix) is not split, a character
prefix being no prompt boundary ("The answer is 4" of "...42" / "...41").
A pair whose two responses differ only in whitespace or in trailing special tokens (an end-of-turn, eos) is a
`same_response` skip as identical responses are (`_same`: roll_core.near_duplicates' whitespace rule, `loose_text`,
over the decoded responses and over their trained tokens): it has next to no preference signal. So is a pair
whose responses are equal up to their last trained token and differ only in untrained context after it (a later
user turn or observation cut by the length limit where the two differ): the same tokens trained after the same
context, a constant loss (log 2 for DPO) with no gradient.
Both sides tokenise through `SFTTokenizer` (so chosen and rejected have the same prompt ids and each response ends
with its end-of-turn token) and get the length limits; a row whose either side is skipped is skipped.

Rollout rows (`prompt_ids`, `response_ids`, optional `response_mask`, `reward` and/or `correct`, and a prompt id
column `data.group_key`; rows without one are grouped by their prompt_ids): a sample's score is read from one
column for every row of a load (`score_column`): the 0/1 flag `data.correct_key` when it is set and any row has it
(rollout-only output always has it), else the number `data.reward_key` (`data.correct_key=null` picks the reward:
a judge's or a reward model's continuous score). A row without that column is a `missing_field` skip (one scale for
every score: a flag was compared with another row's reward). `check_score_settings` refuses `data.min_score` and
`data.pair_margin` values that mean nothing on the flag (min_score 0.7, pair_margin 0.2: they were read as 1 and 0,
silently). Within one prompt, a candidate pair is two samples whose scores differ by more than `data.pair_margin`,
the higher one chosen, whose responses differ (`_same`: more than whitespace or trailing special tokens, or in
the loss mask, before the last trained token), and whose contents (chosen's and rejected's tokens) no earlier
candidate has (a response sampled twice gave the same pair twice, training it twice as hard).
Up to `data.pairs_per_prompt` candidates are taken in an order shuffled by a stream seeded from (seed, prompt id),
preferring samples not yet in a pair, so the pairs depend on the seed and the rows, not on the file's order across
prompts. Prompts without any candidate are counted (`prompts_without_pair`).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roll_core.errors import ConfigError
from roll_core.near_duplicates import loose_text
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.row_values import (
    chat_messages,
    check_messages,
    check_text,
    need,
    renamed_roles,
    train_flag,
)
from roll_core.posttrain.rows import RawRow, SkipRow, Skips
from roll_core.posttrain.tokenize import SFTTokenizer, TokenRow

PREFERENCE_FORMATS = ("preference", "rollout")
#: The `no_prompt` skip of text sides without a prompt column (`parse_preference`).
_TEXT_WITHOUT_PROMPT = (
    "no {p!r} beside text {c!r}/{r!r}: text answers need their prompt in the {p!r} column (data.prompt_key names "
    "it); only message lists carry an implicit prompt (a shared text prefix, as in TRL's implicit-prompt text "
    "rows such as Anthropic HH's transcripts, is not split into a prompt and answers)"
)


@dataclass
class Pair:
    """A chosen and a rejected response to one prompt (equal `prompt_ids`)."""

    chosen: TokenRow
    rejected: TokenRow
    where: str = ""

    @property
    def key(self) -> str:
        return self.chosen.key


# ---- explicit preference rows -----------------------------------------------------------------------------------
def parse_preference(raw: RawRow, sft: SFTTokenizer) -> Pair:
    """One `{prompt?, chosen, rejected}` row to a Pair (SkipRow when a side cannot be tokenised or is too long)."""
    cfg = sft.cfg
    row = raw.row
    chosen, rejected = need(row, cfg.chosen_key), need(row, cfg.rejected_key)
    prompt = row.get(cfg.prompt_key)
    renamed = renamed_roles(prompt, chosen, rejected)  # both sides' (a pair is one example)
    if prompt is None and (isinstance(chosen, str) or isinstance(rejected, str)):
        # Said as such: it was a `wrong_type` skip, "'chosen' must be a non-empty list of messages", which hid the
        # missing prompt column (a misnamed data.prompt_key, or TRL's implicit-prompt text form).
        raise SkipRow("no_prompt", _TEXT_WITHOUT_PROMPT.format(p=cfg.prompt_key, c=cfg.chosen_key, r=cfg.rejected_key))
    if prompt is None or _hold_prompt(prompt, chosen, rejected, cfg):
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected, cfg)
    # text without a template only when every part is text: a message-list side takes the template, and so does the
    # other (one side raw text, the other rendered, tokenised to two prompts: a prompt_mismatch blaming the template)
    as_text = all(isinstance(v, str) for v in (prompt, chosen, rejected)) and not cfg.chat_template
    sides = []
    contexts = []
    answers: list[list[dict[str, Any]]] = []
    for value, key in ((chosen, cfg.chosen_key), (rejected, cfg.rejected_key)):
        if as_text:
            tokens = sft.raw_text(check_text(prompt, cfg.prompt_key), check_text(value, key))
        else:
            p = sft.as_messages(prompt, cfg.prompt_key, "user")
            c = sft.as_messages(value, key, "assistant")
            contexts.append(_before_answer(c))
            if len(contexts) == 2 and contexts[0] != contexts[1]:
                raise SkipRow("prompt_not_shared", _context_diff(contexts, cfg))
            answers.append(c)
            if len(answers) == 2:
                _check_divergence(answers, cfg)
            trained = [False] * len(p) + [train_flag(m) for m in c]
            tokens = sft.chat_row(p + c, trained, row.get("tools"), renamed=renamed)
        tokens.where = f"{raw.where}:{key}"
        sides.append(sft.limit(tokens))
    if sides[0].prompt_ids != sides[1].prompt_ids:  # a template that renders the prompt after reading the answer
        raise SkipRow("prompt_mismatch", "chosen and rejected tokenise to different prompts")
    tok = sft.tokenizer
    if _same(sides[0], sides[1], tok):  # the same answer twice, or cut to max_response_length before they differ
        if sides[0].truncated or sides[1].truncated:
            what = "cut to max_response_length before they differ"
        elif _content(sides[0]) == _content(sides[1]):
            what = "the same answer"
        else:
            what = "the same answer but for whitespace or a trailing end-of-turn / eos token"
        raise SkipRow("same_response", f"chosen and rejected train the same tokens ({what}): no preference signal")
    return Pair(sides[0], sides[1], raw.where)


def _loose(t: TokenRow, tokenizer: Any) -> tuple[str, str]:
    """A side's response as `_same` compares it: the decoded response ids and the decoded trained ids (mask 1),
    each without its trailing special tokens (end-of-turn, eos) and with whitespace collapsed (`loose_text`)."""
    specials = set(getattr(tokenizer, "all_special_ids", None) or ())

    def text(ids: list[int]) -> str:
        while ids and ids[-1] in specials:
            ids = ids[:-1]
        return loose_text(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    trained = [i for i, m in zip(t.response_ids, t.mask) if m]
    return text(list(t.response_ids)), text(trained)


def _same(a: TokenRow, b: TokenRow, tokenizer: Any, keys: tuple[Any, Any] | None = None) -> bool:
    """Whether two sides train the same tokens after the same context (`_trained_part`), or the same text but for
    whitespace or trailing special tokens (`_loose`; `keys`: theirs, when known): a pair of them has next to no
    preference signal (equal tokens: a loss of log 2 and no gradient)."""
    if _trained_part(a) == _trained_part(b):
        return True
    first, second = keys if keys is not None else (_loose(a, tokenizer), _loose(b, tokenizer))
    return first == second


def _trained_part(t: TokenRow) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A side's response ids and mask up to its last trained token: two sides equal there train the same tokens
    after the same context (their log-probs, the policy's and the reference's, are equal: the loss is a constant,
    log 2 for DPO, with no gradient), whatever untrained context follows (a later user turn or observation the
    length limit, or the rollout's, cut where the two differ)."""
    n = max((i + 1 for i, m in enumerate(t.mask) if m), default=0)
    return tuple(t.response_ids[:n]), tuple(t.mask[:n])


def _content(t: TokenRow) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a side trains: its response tokens and their loss mask."""
    return tuple(t.response_ids), tuple(t.mask)


def _before_answer(messages: Sequence[Mapping[str, Any]]) -> list[tuple[Any, Any]]:
    """(role, content) of the messages before a side's first assistant message: context the side adds to the
    prompt (a system prompt in its list, say), which both sides must share."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            break
        out.append((m.get("role"), m.get("content")))
    return out


def _context_diff(contexts: list[list[tuple[Any, Any]]], cfg: DataConfig) -> str:
    """What differs between two sides' messages before their answers (`_before_answer`), for a skip's detail."""
    keys = (cfg.chosen_key, cfg.rejected_key)
    rest = [[m for m in c if m[0] != "system"] for c in contexts]
    systems = [[m for m in c if m[0] == "system"] for c in contexts]
    if rest[0] == rest[1] and not all(systems):
        which = keys[0] if systems[0] else keys[1]
        return f"a system prompt only in {which!r} (before its answer): the two answer different prompts"
    if rest[0] == rest[1]:
        return f"{keys[0]!r} and {keys[1]!r} have different system prompts: the two answer different prompts"
    at = next((i for i, (a, b) in enumerate(zip(*contexts)) if a != b), min(map(len, contexts)))
    roles = [c[at][0] if at < len(c) else None for c in contexts]
    return (
        f"{keys[0]!r} and {keys[1]!r} differ at message {at} before their answers ({roles[0]!r} / {roles[1]!r}): "
        "they answer different prompts"
    )


def _check_divergence(answers: list[list[dict[str, Any]]], cfg: DataConfig) -> None:
    """A `prompt_not_shared` skip for two sides' message lists that share an answer and then first differ at a
    message that is not an assistant answer (a later user turn, a tool result): their later answers reply to
    different messages, as an implicit prompt ending on an assistant message would (`prompt_ends_on_assistant`)."""
    c, r = answers
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
        n += 1
    if 0 < n < min(len(c), len(r)) and (c[n]["role"] != "assistant" or r[n]["role"] != "assistant"):
        raise SkipRow(
            "prompt_not_shared",
            f"{cfg.chosen_key!r} and {cfg.rejected_key!r} share their first {n} message(s), then differ at a "
            f"{c[n]['role']!r} / {r[n]['role']!r} message, not at an assistant answer: their later answers reply "
            "to different messages",
        )


def _hold_prompt(prompt: Any, chosen: Any, rejected: Any, cfg: DataConfig) -> bool:
    """Whether `chosen` and `rejected` are whole conversations that already begin with `prompt` (see the module
    doc): a text prompt beside lists starting with a non-assistant message (one of them, before the answer, must
    hold the prompt's text: a `prompt_not_in_conversation` skip otherwise, the prompt would be dropped), or a
    message-list prompt that both lists start with."""
    # ShareGPT's {"from", "value"} read as chat messages first (their role and content were None here)
    sides = (chat_messages(chosen, cfg.chosen_key), chat_messages(rejected, cfg.rejected_key))
    prompt = chat_messages(prompt, cfg.prompt_key)
    if not all(isinstance(s, (list, tuple)) and s and all(isinstance(m, Mapping) for m in s) for s in sides):
        return False
    if isinstance(prompt, str):
        if not all(s[0].get("role") != "assistant" for s in sides):
            return False
        for side, key in zip(sides, (cfg.chosen_key, cfg.rejected_key)):
            held = [c for _, c in _before_answer(side) if isinstance(c, str)]
            if prompt.strip() not in (c.strip() for c in held):
                raise SkipRow(
                    "prompt_not_in_conversation",
                    f"{cfg.prompt_key!r} is text that {key!r}, a conversation with its own prompt messages, does not "
                    f"hold: read as a whole conversation the row loses the prompt, read as an answer the prompt is "
                    "said twice",
                )
        return True
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) for m in prompt):

        def turns(messages: Sequence[Mapping[str, Any]]) -> list[tuple[Any, Any]]:
            return [(m.get("role"), m.get("content")) for m in messages]

        return all(len(s) > len(prompt) and turns(s[: len(prompt)]) == turns(prompt) for s in sides)
    return False


def _implicit_prompt(chosen: Any, rejected: Any, cfg: DataConfig) -> tuple[list, list, list]:
    """(prompt, chosen rest, rejected rest) from two message lists sharing their first messages."""
    c = check_messages(chosen, cfg.chosen_key)
    r = check_messages(rejected, cfg.rejected_key)
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
        n += 1
    if n == 0:
        sides = f"{cfg.chosen_key!r}/{cfg.rejected_key!r}"
        contexts = [_before_answer(c), _before_answer(r)]
        if contexts[0] and contexts[1]:  # both have prompt messages, different ones (a system prompt in one only)
            raise SkipRow("prompt_not_shared", _context_diff(contexts, cfg))
        raise SkipRow("no_prompt", f"{sides} share no first message to take the prompt from")
    if n == len(c) or n == len(r):
        raise SkipRow("same_response", "chosen and rejected are identical (or one extends the other)")
    # Everything before a side's first trained answer is its prompt: rows that fail these tokenised to different
    # prompts or to a prompt the template cannot end (counted as prompt_mismatch or template_error: misleading).
    shared = f"{cfg.chosen_key!r} and {cfg.rejected_key!r} share {n} first message(s)"
    differ = f"then differ at a {c[n]['role']!r} / {r[n]['role']!r} message"
    if c[n - 1]["role"] == "assistant":
        raise SkipRow(
            "prompt_ends_on_assistant",
            f"{shared}, the last an assistant message, {differ}: the implicit prompt (the shared first messages) "
            "must end on the non-assistant message the two answers reply to",
        )
    if c[n]["role"] != "assistant" or r[n]["role"] != "assistant":
        raise SkipRow(
            "prompt_not_shared",
            f"{shared}, {differ}, not at the two assistant answers: they answer different prompts",
        )
    return c[:n], c[n:], r[n:]


# ---- pairs built from rollout rows ------------------------------------------------------------------------------
@dataclass
class _Sample:
    tokens: TokenRow
    score: float
    group: str


def score_column(rows: Sequence[RawRow], cfg: DataConfig) -> str:
    """The column every row of `rows` is scored by: `data.correct_key` when it is set and any row has a value
    there, else `data.reward_key` (see the module doc)."""
    key = cfg.correct_key
    if key is not None and any(raw.row.get(key) is not None for raw in rows):
        return key
    return cfg.reward_key


def check_score_settings(column: str, cfg: DataConfig, setting: str, what: str) -> None:
    """A ConfigError for the setting `what` uses (`min_score`: SFT and distillation rows, `pair_margin`: pairs) when
    its value means nothing on the 0/1 flag `data.correct_key` (a threshold between 0 and 1 keeps the samples 1
    keeps; any margin below 1 gives the pairs 0 gives, 1 or more none): the user meant a continuous reward."""
    if column != cfg.correct_key:
        return
    use_reward = (
        f"to use the number in {cfg.reward_key!r} (a judge's or reward model's score) set data.correct_key=null"
    )
    if what == "min_score" and cfg.min_score is not None and cfg.min_score not in (0.0, 1.0):
        raise ConfigError(
            f"{setting}: data.min_score={cfg.min_score} is compared with the rows' 0/1 {column!r} flag, where only "
            f"1 (the correct samples) and 0 (all) mean something: set data.min_score=1 to keep the correct samples, "
            f"or {use_reward}"
        )
    if what == "pair_margin" and cfg.pair_margin > 0:
        raise ConfigError(
            f"{setting}: data.pair_margin={cfg.pair_margin} is compared with differences of the rows' 0/1 {column!r} "
            f"flag (0 or 1): set data.pair_margin=0 to pair correct over incorrect samples, or {use_reward}"
        )


def score_of(row: Mapping[str, Any], cfg: DataConfig, column: str) -> float:
    """The row's score in `column` (a `score_column`): 0/1 for the correct flag, a finite number for the reward;
    a `missing_field` or `wrong_type` skip otherwise."""
    value = need(row, column)
    if column == cfg.correct_key:
        if isinstance(value, bool) or (isinstance(value, (int, float)) and value in (0, 1)):
            return float(value)
        raise SkipRow("wrong_type", f"{column!r} must be true/false or 0/1, got {str(value)[:40]}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SkipRow("wrong_type", f"{column!r} must be a finite number, got {str(value)[:40]}")
    return float(value)


def _group(row: Mapping[str, Any], tokens: TokenRow, cfg: DataConfig) -> str:
    group = row.get(cfg.group_key)
    if group is None:
        return tokens.key  # the prompt ids themselves
    if isinstance(group, (str, int)) and not isinstance(group, bool):
        return f"{cfg.group_key}={group}"
    raise SkipRow("wrong_type", f"{cfg.group_key!r} must be text or an integer, got {str(group)[:40]}")


def pair_stream(seed: int, group: str) -> random.Random:
    """The random stream that orders one prompt's candidate pairs (a pure function of seed and prompt id)."""
    h = hashlib.blake2b(b"preference_pairs", digest_size=8)
    h.update(int(seed).to_bytes(16, "little", signed=True))
    h.update(group.encode())
    return random.Random(int.from_bytes(h.digest(), "little"))


def build_pairs(
    rows: Sequence[RawRow],
    sft: SFTTokenizer,
    *,
    seed: int,
    skips: Skips,
    stats: dict[str, int],
    setting: str = "data.path",
) -> list[Pair]:
    """Pairs of rollout samples of one prompt (see the module doc). Bad rows go to `skips`; `stats` gets
    `prompts`, `prompts_without_pair` and `pairs`. A ConfigError for a `data.pair_margin` the score column cannot
    mean (`check_score_settings`), and for a file whose every row is bad, even beside good ones (as for SFT rows)."""
    cfg = sft.cfg
    column = score_column(rows, cfg)
    check_score_settings(column, cfg, setting, "pair_margin")
    groups: dict[str, list[_Sample]] = {}
    own: dict[str, Skips] = {}  # per file: a shard of another tokenizer was dropped whole with a warning
    kept: dict[str, int] = {}
    for raw in rows:
        kept.setdefault(raw.file, 0)
        try:
            tokens = sft.tokens(raw.row, "tokens")
            tokens.where = raw.where
            sample = _Sample(sft.limit(tokens), score_of(raw.row, cfg, column), _group(raw.row, tokens, cfg))
            first = groups.get(sample.group)
            if first and first[0].tokens.prompt_ids != tokens.prompt_ids:
                raise SkipRow("prompt_mismatch", f"{sample.group}: prompt_ids differ from the prompt's first row's")
        except SkipRow as skip:
            own.setdefault(raw.file, Skips()).add(raw.where, skip.reason, skip.detail)
            continue
        kept[raw.file] += 1
        groups.setdefault(sample.group, []).append(sample)
    for file, file_skips in own.items():
        file_skips.check_any(kept[file], f"{setting} ({file})")
        skips.merge(file_skips)
    pairs: list[Pair] = []
    without = 0
    tok = sft.tokenizer
    for group, samples in groups.items():
        candidates: list[tuple[int, int]] = []
        seen: set[tuple[tuple[int, ...], ...]] = set()
        loose = [_loose(s.tokens, tok) for s in samples]
        for i, a in enumerate(samples):
            for j, b in enumerate(samples):
                if a.score - b.score <= cfg.pair_margin:
                    continue
                if _same(a.tokens, b.tokens, tok, (loose[i], loose[j])):  # truncated alike, or but for whitespace
                    continue
                content = (*_content(a.tokens), *_content(b.tokens))
                if content not in seen:  # a response sampled twice: one pair, not the same pair twice
                    seen.add(content)
                    candidates.append((i, j))
        if not candidates:
            without += 1
            continue
        pair_stream(seed, group).shuffle(candidates)
        used: set[int] = set()
        picked: list[tuple[int, int]] = []
        for fresh_only in (True, False):  # samples not yet paired first, then reuse them
            for i, j in candidates:
                if len(picked) == cfg.pairs_per_prompt:
                    break
                if (i, j) in picked or (fresh_only and (i in used or j in used)):
                    continue
                picked.append((i, j))
                used |= {i, j}
        for i, j in picked:
            c, r = samples[i].tokens, samples[j].tokens
            pairs.append(Pair(c, r, f"{c.where}>{r.where}"))
    stats.update(prompts=len(groups), prompts_without_pair=without, pairs=len(pairs))
    return pairs
