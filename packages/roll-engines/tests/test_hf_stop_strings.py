"""The hf engine's stop strings (HFInferEngine._prepare builds each request's StopStrings): a stop string is
caught at exactly the token that completes it, however many tokens it spans, byte tokens included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from roll_core.interfaces import SamplingParams
from roll_core.interfaces.inference import Request
from roll_engines.infer.hf import HFInferEngine


class ByteTokenizer:
    """A byte-level vocabulary without merges: token i is byte i (a character outside ASCII is 2-4 tokens), decoded
    as a byte-level BPE tokenizer decodes an incomplete character: U+FFFD."""

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class WordTokenizer:
    """Multi-character tokens: a stop string can start inside one token and end inside another."""

    vocab = ("The", " ans", "wer", ":", " 4", "2.", "\n")

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(self.vocab[i] for i in ids)


def _stops(tokenizer: Any, stop: tuple[str, ...]) -> Any:
    """The StopStrings the engine gives a request with `stop` (no model: only the tokenizer is read)."""
    engine = object.__new__(HFInferEngine)
    engine.tokenizer, engine.vision, engine.name, engine.path = tokenizer, None, "hf", "stub"
    engine._seeds, engine._vocab = torch.Generator().manual_seed(0), 256
    return engine._prepare(Request("r", [1], SamplingParams(stop=stop))).stop


def _first_hit(stops: Any, tokens: list[int]) -> int | None:
    """The number of generated tokens at which the engine would stop (None: never)."""
    return next((n for n in range(1, len(tokens) + 1) if stops.hit(tokens[:n])), None)


@pytest.mark.parametrize("text", ["\U0001f6d1\U0001f6d1\U0001f6d1", "\u7b54\u6848\u662f\uff1a", "END"])
def test_a_stop_string_of_byte_tokens_is_caught_at_its_last_byte(text: str) -> None:
    """Three emoji are 12 byte tokens, more than the old window of len(stop) + 8 = 11: never matched."""
    prefix = b"a long answer, then "
    tokens = [*prefix, *text.encode(), *b" trailing"]
    stops = _stops(ByteTokenizer(), (text,))
    assert _first_hit(stops, tokens) == len(prefix) + len(text.encode())


def test_a_stop_string_spanning_three_tokens_is_caught_at_the_token_completing_it() -> None:
    # "The answer: 42.\n": "answer: 4" starts inside " ans" and ends inside " 4"; "2." overhangs nothing
    stops = _stops(WordTokenizer(), ("answer: 4", "zzz"))
    assert _first_hit(stops, [0, 1, 2, 3, 4, 5, 6]) == 5
    assert _first_hit(_stops(WordTokenizer(), ("42.\n",)), [0, 1, 2, 3, 4, 5, 6]) == 7  # over 3 tokens
    assert _first_hit(_stops(WordTokenizer(), ("43",)), [0, 1, 2, 3, 4, 5, 6]) is None
