"""The dummy plugin engine (`infer_engine=recompute`) matches stop strings where the hf engine (and vLLM) match them:
on the response as it reads after the prompt. It decoded the response alone, and a SentencePiece tokenizer drops the
leading space of the first word then: a stop string " b" that the response starts with (its first token "▁b")
was never matched, and the response ran on where the hf engine stopped after that token."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from roll_core.interfaces import SamplingParams


def sentencepiece_like_tokenizer() -> Any:
    """A word-level tokenizer with SentencePiece's word marker: every word token starts with "▁" (a space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"] + ["\u2581" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_a_stop_string_with_the_first_words_leading_space_stops_as_on_the_hf_engine(tmp_path: Path) -> None:
    import torch
    from roll_dummy_engine.engine import RecomputeInferEngine
    from transformers import LlamaConfig, LlamaForCausalLM

    from roll_engines.infer.hf import HFInferEngine

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    tok = sentencepiece_like_tokenizer()
    prompt = tok("a b c", add_special_tokens=False)["input_ids"]
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    folder = tmp_path / "model"
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    rc = RecomputeInferEngine(str(folder))
    free = rc.generate([prompt], greedy).responses[0].tolist()
    first = free[0]
    assert first > 2, "the greedy response starts with a word"  # (a special token has no leading space)
    stop = " " + tok.convert_ids_to_tokens(first)[1:]  # " b": the first word as it reads after the prompt
    assert tok.decode([*prompt, first]).endswith(stop) and not tok.decode([first]).startswith(" ")
    hf = HFInferEngine(str(folder))
    try:
        for engine in (hf, rc):
            out = engine.generate([prompt], greedy.replace(stop=(stop,)))
            got = out.responses[0][out.response_mask[0].bool()].tolist()
            assert (got, out.finish_reasons) == ([first], ["stop"]), engine.name
    finally:
        hf.shutdown()
