"""`tokenizer_fingerprint` depends on what decides token ids (vocabulary, merges, normalizer and pre-tokenizer by
what they do, added / special tokens, chat template) and on nothing else: not on how a tokenizers version
serialises the same tokenizer, nor on padding settings. A byte-level BPE tokenizer is trained here (no download)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.errors import ConfigError
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.source import load_rows
from roll_core.posttrain.tokenize import tokenizer_fingerprint
from roll_core.testing.chat_templates import family_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "1234 5678 the end"] * 20
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def bpe_spec() -> dict[str, Any]:
    """A small byte-level BPE tokenizer (ChatML specials) as the tokenizers JSON of the installed version."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return json.loads(tok.to_str())


def build(spec: dict[str, Any], **extra: Any) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|im_end|>")
    tok.chat_template = TEMPLATE
    for k, v in extra.items():
        setattr(tok, k, v)
    return tok


class Serialised:
    """`tok` as another tokenizers version writes it: the same tokenizer, its JSON laid out as `edit` makes it."""

    def __init__(self, tok: Any, edit: Any) -> None:
        spec = json.loads(tok.backend_tokenizer.to_str())
        edit(spec)
        self._tok, self._json = tok, json.dumps(spec)

    @property
    def backend_tokenizer(self) -> Any:
        return SimpleNamespace(to_str=lambda: self._json)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def older_layout(spec: dict[str, Any]) -> None:
    """tokenizers < 0.20: merges as "a b" strings; keys added later (at their defaults) absent; another decoder."""
    model = spec["model"]
    assert model["merges"] and isinstance(model["merges"][0], list)
    model["merges"] = [" ".join(m) for m in model["merges"]]
    for key in ("ignore_merges", "byte_fallback", "fuse_unk"):
        model.pop(key, None)
    spec["pre_tokenizer"].pop("use_regex", None)
    spec["version"] = "0.9"
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True}


def test_the_same_tokenizer_serialised_by_another_version_keeps_its_fingerprint() -> None:
    tok = build(bpe_spec())
    old = Serialised(tok, older_layout)
    assert tokenizer_fingerprint(old) == tokenizer_fingerprint(tok)
    # padding / truncation / pad token / length limits decide no id the models see
    padded = build(bpe_spec(), pad_token="<|endoftext|>", padding_side="left", model_max_length=7)
    padded(["a", "abc"], padding=True, truncation=True, max_length=2)
    assert tokenizer_fingerprint(padded) == tokenizer_fingerprint(tok)


def test_what_decides_ids_changes_the_fingerprint() -> None:
    spec = bpe_spec()
    base = tokenizer_fingerprint(build(spec))
    swapped = json.loads(json.dumps(spec))
    merges = swapped["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]  # merge priority
    lower = {**spec, "normalizer": {"type": "Lowercase"}}  # seen only through what it does to the probes
    digits = {**spec, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, spec["pre_tokenizer"]]}}  # fmt: skip
    lstrip = json.loads(json.dumps(spec))
    lstrip["added_tokens"][2]["lstrip"] = True
    variants = {
        "merges": build(swapped),
        "normalizer": build(lower),
        "pre_tokenizer": build(digits),
        "added token flag": build(lstrip),
        "chat template": build(spec, chat_template=TEMPLATE + "x"),
        "eos": build(spec, eos_token="<|endoftext|>"),
    }
    for name, tok in variants.items():
        assert tokenizer_fingerprint(tok) != base, name
    assert len({tokenizer_fingerprint(t) for t in variants.values()}) == len(variants)


def test_rows_stamped_with_the_previous_fingerprint_still_load(tmp_path: Path) -> None:
    """A distillation file stamped by roll's previous fingerprint (the serialised JSON's hash) names the same
    tokenizer under the same library versions: accepted; any other stamp is still an error naming both."""
    from roll_core.posttrain.tokenize import legacy_tokenizer_fingerprint

    tok = family_tokenizer("tiny")
    row = {"prompt_ids": [5, 6], "response_ids": [7, 8], "teacher_topk_ids": [[3, 4]] * 2,
           "teacher_topk_logprobs": [[-0.5, -1.5]] * 2}  # fmt: skip
    assert legacy_tokenizer_fingerprint(tok) != tokenizer_fingerprint(tok)

    def load(stamp: str) -> Any:
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps({**row, "tokenizer": stamp}) + "\n")
        return load_rows("distill", DataConfig(path=str(path)), tok, max_prompt_length=8, max_response_length=8)

    assert len(load(legacy_tokenizer_fingerprint(tok)).train) == 1
    assert len(load(tokenizer_fingerprint(tok)).train) == 1
    with pytest.raises(ConfigError, match=rf"tokenizer sha256:0123 is not the student's {tokenizer_fingerprint(tok)}"):
        load("sha256:0123")
