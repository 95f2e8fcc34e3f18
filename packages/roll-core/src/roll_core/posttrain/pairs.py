"""Preference pairs: from `{prompt, chosen, rejected}` rows, or built from a rollout-only output file.

Preference rows (TRL's forms): `prompt` text or messages with `chosen` / `rejected` text or messages (explicit
prompt), or no prompt and `chosen` / `rejected` message lists sharing their first messages (implicit prompt: the
longest common prefix of the two lists, which must end on a non-assistant message). Lists that already hold the
prompt are read as the implicit form, the `prompt` column aside (it would otherwise be rendered twice): beside a
text prompt, lists that start with a non-assistant message (HuggingFaceH4/ultrafeedback_binarized's layout, as
TRL's `maybe_extract_prompt` reads it); beside a message-list prompt, lists that start with its messages (same
roles and contents). Text prompt and responses follow `data.chat_template` like SFT's prompt/completion rows.
Both sides tokenise through `SFTTokenizer` (so chosen and rejected have the same prompt ids and each response ends
with its end-of-turn token) and get the length limits; a row whose either side is skipped is skipped.

Rollout rows (`prompt_ids`, `response_ids`, optional `response_mask`, `reward` and/or `correct`, and a prompt id
column `data.group_key`; rows without one are grouped by their prompt_ids): a sample's score is `correct` (0/1)
when the row has it, else `reward`. Within one prompt, a candidate pair is two samples whose scores differ by more
than `data.pair_margin`, the higher one chosen. Up to `data.pairs_per_prompt` candidates are taken in an order
shuffled by a stream seeded from (seed, prompt id), preferring samples not yet in a pair, so the pairs depend on
the seed and the rows, not on the file's order across prompts. Prompts without any candidate are counted
(`prompts_without_pair`).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.rows import RawRow, SkipRow, Skips
from roll_core.posttrain.tokenize import SFTTokenizer, TokenRow, check_messages, check_text, need, train_flag

PREFERENCE_FORMATS = ("preference", "rollout")


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
    if prompt is None or _hold_prompt(prompt, chosen, rejected):
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected, cfg)
    sides = []
    for value, key in ((chosen, cfg.chosen_key), (rejected, cfg.rejected_key)):
        if isinstance(prompt, str) and isinstance(value, str) and not cfg.chat_template:
            tokens = sft.raw_text(check_text(prompt, cfg.prompt_key), check_text(value, key))
        else:
            p = sft.as_messages(prompt, cfg.prompt_key, "user")
            c = sft.as_messages(value, key, "assistant")
            trained = [False] * len(p) + [train_flag(m) for m in c]
            tokens = sft.chat_row(p + c, trained, row.get("tools"))
        tokens.where = f"{raw.where}:{key}"
        sides.append(sft.limit(tokens))
    if sides[0].prompt_ids != sides[1].prompt_ids:  # a template that renders the prompt after reading the answer
        raise SkipRow("prompt_mismatch", "chosen and rejected tokenise to different prompts")
    if _same(sides[0], sides[1]):  # e.g. cut to model.max_response_length before they differ: no signal
        raise SkipRow("same_response", "chosen and rejected are identical after truncation to max_response_length")
    return Pair(sides[0], sides[1], raw.where)


def _same(a: TokenRow, b: TokenRow) -> bool:
    """Whether two sides train the same tokens (a pair of them has a loss of log 2 and no gradient)."""
    return a.response_ids == b.response_ids and a.mask == b.mask


def _hold_prompt(prompt: Any, chosen: Any, rejected: Any) -> bool:
    """Whether `chosen` and `rejected` are whole conversations that already begin with `prompt` (see the module
    doc): a text prompt beside lists starting with a non-assistant message, or a message-list prompt that both
    lists start with."""
    sides = (chosen, rejected)
    if not all(isinstance(s, (list, tuple)) and s and all(isinstance(m, Mapping) for m in s) for s in sides):
        return False
    if isinstance(prompt, str):
        return all(s[0].get("role") != "assistant" for s in sides)
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
        raise SkipRow("no_prompt", f"{sides} share no first message to take the prompt from")
    if n == len(c) or n == len(r):
        raise SkipRow("same_response", "chosen and rejected are identical (or one extends the other)")
    return c[:n], c[n:], r[n:]


# ---- pairs built from rollout rows ------------------------------------------------------------------------------
@dataclass
class _Sample:
    tokens: TokenRow
    score: float
    group: str


def score_of(row: Mapping[str, Any], cfg: DataConfig) -> float:
    correct = row.get(cfg.correct_key)
    if correct is not None:
        if isinstance(correct, bool) or (isinstance(correct, (int, float)) and correct in (0, 1)):
            return float(correct)
        raise SkipRow("wrong_type", f"{cfg.correct_key!r} must be true/false or 0/1, got {correct!r}")
    reward = need(row, cfg.reward_key)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise SkipRow("wrong_type", f"{cfg.reward_key!r} must be a finite number, got {reward!r}")
    return float(reward)


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
    rows: Sequence[RawRow], sft: SFTTokenizer, *, seed: int, skips: Skips, stats: dict[str, int]
) -> list[Pair]:
    """Pairs of rollout samples of one prompt (see the module doc). Bad rows go to `skips`; `stats` gets
    `prompts`, `prompts_without_pair` and `pairs`."""
    cfg = sft.cfg
    groups: dict[str, list[_Sample]] = {}
    for raw in rows:
        try:
            tokens = sft.tokens(raw.row, "tokens")
            tokens.where = raw.where
            sample = _Sample(sft.limit(tokens), score_of(raw.row, cfg), _group(raw.row, tokens, cfg))
            first = groups.get(sample.group)
            if first and first[0].tokens.prompt_ids != tokens.prompt_ids:
                raise SkipRow("prompt_mismatch", f"{sample.group}: prompt_ids differ from the prompt's first row's")
        except SkipRow as skip:
            skips.add(raw.where, skip.reason, skip.detail)
            continue
        groups.setdefault(sample.group, []).append(sample)
    pairs: list[Pair] = []
    without = 0
    for group, samples in groups.items():
        candidates = [
            (i, j)
            for i, a in enumerate(samples)
            for j, b in enumerate(samples)
            if a.score - b.score > cfg.pair_margin and not _same(a.tokens, b.tokens)  # truncated alike: no signal
        ]
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


def group_key_of(pair: Pair) -> str:
    """The key that keeps a prompt's pairs on one side of the held-out split."""
    return json.dumps(pair.chosen.prompt_ids)
