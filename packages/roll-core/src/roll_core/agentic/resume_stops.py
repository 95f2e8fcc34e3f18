"""Stop strings across the attempts of a resumed turn.

Contract: an engine matches a request's stop strings on the text it generated after the request's prompt (roll's
hf, vLLM and SGLang engines alike: roll_core.interfaces.inference). A turn resumed after an abort
(roll_core.agentic.rollout: a weight sync with partial rollout, the engine's own preemption) is a new request whose
prompt holds the earlier attempts' tokens, so a stop string the earlier attempts began and the resumed one
completed (`</ans` + `wer>`) was matched by no engine and the turn ran on. `split_stop` finds the token that
completes such a string over the joined tokens, so that the turn is cut where an unaborted turn would have been:
at that token (kept), finish reason `stop`.

The text is read as the engines read it: the response's tokens decoded behind a few tokens of context (the prompt's
last tokens where the response is short; a SentencePiece tokenizer's leading space stays), special tokens kept, a
string counting where the token that completes it (or passes through its end) was added. Only strings that begin
in the earlier attempts need this (the engine matched the others itself), so only the first `stop_window` tokens of
the latest attempt are read, each behind at most `stop_window` earlier tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Tokens decoded before the text read, then cut off (roll_engines.infer._sampling's `_CONTEXT`, as vLLM's prompt
#: tail): a SentencePiece decoder drops the leading space of a string's first token.
CONTEXT_TOKENS = 4


def stop_window(stops: Sequence[str]) -> int:
    """Tokens a stop string can span: its UTF-8 bytes (a byte-fallback tokenizer spells a character with up to 4
    byte tokens) plus 8 (special tokens, merges): the window the hf engine reads (roll_engines.infer._sampling)."""
    return max((len(s.encode("utf-8")) for s in stops if s), default=0) + 8


def split_stop(
    tokenizer: Any, prompt: Sequence[int], tokens: Sequence[int], start: int, stops: Sequence[str]
) -> int | None:
    """How many of `tokens` (a turn's response so far, after `prompt`) an unaborted turn would have kept: one past
    the first token at index >= `start` (where the latest attempt's tokens begin) that completes a stop string, read
    over the first `stop_window` tokens from `start`; None when none does there (a string wholly within the latest
    attempt, further on, the engine matched itself)."""
    stops = [s for s in stops if s]
    if not stops or start <= 0 or start >= len(tokens):
        return None
    window = stop_window(stops)
    lo = max(0, start - window)  # a string begun before `start` begins at or after `lo`
    joined = [int(t) for t in prompt] + [int(t) for t in tokens]
    base = len(prompt) + lo  # where the text read begins in `joined`
    context = joined[max(0, base - CONTEXT_TOKENS) : base]
    head = tokenizer.decode(context, skip_special_tokens=False) if context else ""

    def text(end: int) -> str:
        """The text of tokens[lo:end] as it reads after `context`."""
        whole = tokenizer.decode(context + joined[base : len(prompt) + end], skip_special_tokens=False)
        if not context or whole.startswith(head):
            return whole[len(head) :]
        # a context ending inside a character (byte tokens) decodes to U+FFFD there: cut where the two part
        return whole[next((i for i, (a, b) in enumerate(zip(head, whole)) if a != b), len(whole)) :]

    before = text(start)
    for end in range(start + 1, min(len(tokens), start + window) + 1):
        now = text(end)
        # complete with this token and not before it (the earlier attempts completed none: the engine stops there)
        if any(s in now and s not in before for s in stops):
            return end
        before = now
    return None
