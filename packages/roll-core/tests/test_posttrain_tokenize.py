"""roll_core.posttrain.tokenize with a SentencePiece-style tokenizer (Llama 2's legacy normalizer: a "\u2581" put
before the text and every space turned into one, a bos added in front), built locally from a word-level vocabulary
so that the expected ids are spelt out by hand."""

from __future__ import annotations

import pytest

from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.rows import RawRow
from roll_core.posttrain.tokenize import SFTTokenizer

SP = "\u2581"
WORDS = ["[INST]", "What", "is", "2+2?", "[/INST]", "Answer:", "It", "4", "not"]
# Llama 2's template: the answer after "[/INST]" and a space, then a space and eos
LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + m.content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def sp_tokenizer(*, append_eos: bool = False):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", SP, *WORDS, *(SP + w for w in WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SP), normalizers.Replace(" ", SP)])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="never", split=True)
    tok.decoder = decoders.Metaspace(replacement=SP, prepend_scheme="always", split=True)
    single = "<s> $A </s>" if append_eos else "<s> $A"
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = LLAMA2
    return fast


def ids(tok, *tokens: str) -> list[int]:
    return tok.convert_tokens_to_ids(list(tokens))


def sft(tok, **data) -> SFTTokenizer:
    return SFTTokenizer(tok, DataConfig(**data), max_prompt_length=100, max_response_length=100)


ANSWER = ids(sp_tokenizer(), SP + "It", SP + "is", SP + "4", "</s>")


def test_an_answer_is_tokenised_as_it_follows_the_prompt_not_with_a_prefix_space():
    """Encoded on its own, " It is 4" became "\u2581" "\u2581It" ...: every response started with a lone space token
    the text (and the whole conversation's tokenisation) does not have, which the model learned to emit first."""
    tok = sp_tokenizer()
    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4"}]
    row = sft(tok).tokens({"messages": chat}, "messages")
    assert row.response_ids == ANSWER and row.mask == [1] * 4
    whole = tok.apply_chat_template(chat, return_dict=False)  # "... [/INST] It is 4 </s>": ids up to the answer's end
    assert row.prompt_ids + row.response_ids[:-1] == whole[: len(row.prompt_ids) + 3]
    for completion in (" It is 4", "It is 4"):  # raw text: the completion's ids as they follow the prompt
        raw = sft(tok, chat_template=False).tokens(
            {"prompt": "What is 2+2? Answer:", "completion": completion}, "prompt_completion"
        )
        assert raw.prompt_ids == ids(tok, "<s>", SP + "What", SP + "is", SP + "2+2?", SP + "Answer:")
        assert raw.response_ids == ANSWER


@pytest.mark.parametrize("append_eos", [False, True])
@pytest.mark.parametrize("prompt, completion", [("What is 2+2?", "It is 4"), ("<s>What is 2+2?", "It is 4</s>")])
def test_raw_text_adds_bos_and_eos_once(append_eos, prompt, completion):
    """data.chat_template=false: text already holding bos / eos (pre-rendered rows) got a second one, and a tokenizer
    whose post-processor appends eos (add_eos_token) ended every prompt with eos, before the answer."""
    tok = sp_tokenizer(append_eos=append_eos)
    row = sft(tok, chat_template=False).tokens({"prompt": prompt, "completion": completion}, "prompt_completion")
    assert row.prompt_ids == ids(tok, "<s>", SP + "What", SP + "is", SP + "2+2?")
    assert row.response_ids == ANSWER and row.mask == [1] * 4


def test_preference_text_pairs_share_the_prompt_and_have_no_prefix_space():
    from roll_core.posttrain.pairs import parse_preference

    tok = sp_tokenizer()
    raw = RawRow("p.jsonl:1", {"prompt": "What is 2+2?", "chosen": " It is 4", "rejected": " It is not 4"}, "p.jsonl")
    pair = parse_preference(raw, sft(tok, chat_template=False))
    assert pair.chosen.prompt_ids == pair.rejected.prompt_ids
    assert pair.chosen.response_ids == ANSWER
    assert pair.rejected.response_ids == ids(tok, SP + "It", SP + "is", SP + "not", SP + "4", "</s>")


@pytest.mark.parametrize("mask", [[[1], [0]], [{"m": 1}, 1], "10", [1, 2], [1]])
def test_a_malformed_response_mask_is_a_counted_skip(mask):
    """A nested-list (or dict) mask raised TypeError out of the loader (a set of lists), ending the whole load."""
    from roll_core.posttrain.rows import SkipRow

    enc = sft(sp_tokenizer())
    with pytest.raises(SkipRow, match=r"bad_mask"):
        enc.tokens({"prompt_ids": [1, 5], "response_ids": [7, 8], "response_mask": mask}, "tokens")
    row = enc.tokens({"prompt_ids": [1, 5], "response_ids": [7, 8], "response_mask": [True, 0.0]}, "tokens")
    assert row.mask == [1, 0]
