"""The hf engine's stop strings (HFInferEngine._prepare builds each request's StopStrings): a stop string is
caught at exactly the token that completes it, however many tokens it spans, byte tokens included, in the
response's text as it reads after the prompt (as vLLM reads it)."""

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


def _stops(tokenizer: Any, stop: tuple[str, ...], prompt: tuple[int, ...] = (1,)) -> Any:
    """The StopStrings the engine gives a request with `stop` (no model: only the tokenizer is read)."""
    engine = object.__new__(HFInferEngine)
    engine.tokenizer, engine.vision, engine.name, engine.path = tokenizer, None, "hf", "stub"
    engine._seeds, engine._vocab = torch.Generator().manual_seed(0), 256
    return engine._prepare(Request("r", list(prompt), SamplingParams(stop=stop))).stop


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


SP = "\u2581"


def sp_tokenizer() -> Any:
    """A SentencePiece-style tokenizer (Llama 2, Mistral, Gemma) built locally from a word-level vocabulary: a space
    is a "\u2581" in the token, and the decoder drops the one a string starts with ("\u2581Human" alone is "Human")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["Human", "Assistant", ":", "Hi", "there"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", SP, *words, *(SP + w for w in words)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement=SP, prepend_scheme="always", split=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_stop_string_with_a_leading_space_is_caught_at_the_first_response_token() -> None:
    """vLLM decodes the response after the prompt (a DecodeStream primed with the prompt's ids): its text is
    " Human: Hi", and " Human:" stops at the second token. The response decoded alone read "Human: Hi": never."""
    from tokenizers.decoders import DecodeStream

    tok = sp_tokenizer()
    ids = tok.convert_tokens_to_ids
    prompt = ids(["<s>", SP + "Human", ":", SP + "Hi", SP + "Assistant", ":"])
    response = ids([SP + "Human", ":", SP + "Hi"])
    stream = DecodeStream(ids=prompt, skip_special_tokens=False)
    assert "".join(stream.step(tok._tokenizer, i) for i in response) == " Human: Hi"  # vLLM's response text
    assert tok.decode(response) == "Human: Hi"
    assert _first_hit(_stops(tok, (" Human:",), tuple(prompt)), response) == 2
    assert _first_hit(_stops(tok, (" Hi",), tuple(prompt)), response) == 3
    # After a lone bos too ("<s> Human: Hi" as a whole)
    stream = DecodeStream(ids=prompt[:1], skip_special_tokens=False)
    assert "".join(stream.step(tok._tokenizer, i) for i in response) == " Human: Hi"
    assert _first_hit(_stops(tok, (" Human:",), tuple(prompt[:1])), response) == 2


def test_a_stop_string_in_the_prompt_or_starting_there_is_not_matched() -> None:
    """vLLM matches the response's text only: "Human:" ends the prompt, " Human" ends it and ":" starts the reply."""
    tok = sp_tokenizer()
    ids = tok.convert_tokens_to_ids
    response = ids([SP + "Hi", SP + "there", ":"])
    assert _first_hit(_stops(tok, (" Human:", "Human:"), tuple(ids(["<s>", SP + "Human", ":"]))), response) is None
    assert _first_hit(_stops(tok, ("Human:",), tuple(ids(["<s>", SP + "Human"]))), ids([":", SP + "Hi"])) is None
    assert _first_hit(_stops(tok, ("there:",), tuple(ids(["<s>", SP + "Human", ":"]))), response) == 3


def test_a_character_begun_in_the_prompt_is_read_whole() -> None:
    """The prompt ends with the first two bytes of an emoji and the response holds the other two: vLLM's response
    text starts with the whole emoji. The response's bytes decoded alone were two U+FFFD: never matched."""
    emoji = "\U0001f6d1".encode()
    stops = _stops(ByteTokenizer(), ("\U0001f6d1",), (*b"stop: ", *emoji[:2]))
    assert _first_hit(stops, [*emoji[2:], *b" then"]) == 2
