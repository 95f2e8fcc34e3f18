"""Preference rows a TRL user brings that roll cannot train say what is wrong: text chosen/rejected without a prompt
column (TRL's implicit-prompt text form, e.g. Anthropic HH's transcripts, or a misnamed `data.prompt_key`) are a
`no_prompt` skip naming the prompt column, and a null chosen is said to be null. Character-level family tokenizer,
real JSONL files."""

from __future__ import annotations

import pytest

from roll_core.errors import ConfigError
from roll_core.testing.chat_templates import family_tokenizer
from roll_core.testing.posttrain_rows import load, write_jsonl

TOK = family_tokenizer("chatml")


def test_text_sides_without_a_prompt_column_name_the_prompt_column(tmp_path):
    """{"chosen": text, "rejected": text} without a prompt was a `wrong_type` skip saying "'chosen' must be a
    non-empty list of messages": the user was sent to reshape the answers, not to add the prompt column."""
    hh = {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go away"}
    misnamed = {"question": "2+2?", "chosen": "4", "rejected": "5"}
    one_text_side = {
        "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "rejected": "b",
    }
    good = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    path = write_jsonl(tmp_path / "p.jsonl", [hh, misnamed, one_text_side, good])
    src = load("preference", TOK, path=path).train
    assert len(src) == 1 and src.skipped == {"no_prompt": 3}
    with pytest.raises(ConfigError, match=r"no_prompt: no 'question' beside text 'chosen'/'rejected': .*'question'"):
        load("preference", TOK, path=write_jsonl(tmp_path / "hh.jsonl", [hh]), prompt_key="question")
    # with their prompt column named, the same rows are pairs
    src = load("preference", TOK, path=write_jsonl(tmp_path / "f.jsonl", [misnamed]), prompt_key="question").train
    assert len(src) == 1 and not src.skipped


def test_a_null_side_is_said_to_be_null(tmp_path):
    """A null chosen said "no 'chosen' (the row has ['chosen', ...])", naming the column it claimed was absent."""
    with pytest.raises(ConfigError, match=r"missing_field: 'chosen' is null \(the row has \['chosen'"):
        load(
            "preference",
            TOK,
            path=write_jsonl(tmp_path / "n.jsonl", [{"prompt": "q", "chosen": None, "rejected": "b"}]),
        )
    with pytest.raises(ConfigError, match=r"missing_field: no 'chosen' \(the row has \['prompt'"):
        load(
            "preference",
            TOK,
            path=write_jsonl(tmp_path / "m.jsonl", [{"prompt": "q", "rejected": "b"}]),
            format="preference",
        )
