"""Invisible characters and compatibility forms (roll_envs.rewards.ifeval's docstring): a zero-width space or a
soft hyphen inside a forbidden word, or the word in fullwidth letters, slipped past `forbidden` (a reward hack:
the reader sees "very"); a zero-width space split a word in two for word_count, hid a sentence end or made a
blank line not blank. Look-alike letters of other scripts stay distinct. And a bare IFEval id given as the
constraints was refused as "not JSON" instead of naming IFEval's format."""

from __future__ import annotations

import json

import pytest

from roll_envs.rewards.ifeval import (
    IFEVAL_HINT,
    InstructionReward,
    bullets,
    check,
    count_phrase,
    paragraphs,
    parse_constraints,
    sentences,
    validate_constraint,
    words,
)

C = validate_constraint
HIDDEN_VERY = [
    "ve\u200bry",  # zero-width space
    "ve\u00adry",  # soft hyphen
    "ve\u200cry",  # zero-width non-joiner
    "ve\u200dry",  # zero-width joiner
    "ve\u2060ry",  # word joiner
    "\ufeffvery",  # BOM
    "ve\u200ery",  # left-to-right mark
    "ve\u034fry",  # combining grapheme joiner (default-ignorable, a mark)
    "ve\ufe0fry",  # variation selector
    "ｖｅｒｙ",  # fullwidth
    "ＶＥＲＹ",
]


@pytest.mark.parametrize("hidden", HIDDEN_VERY)
def test_a_hidden_forbidden_word_is_found(hidden: str) -> None:
    response = f"This is {hidden} good."
    assert not check(C({"type": "forbidden", "words": ["very"]}), response)
    assert check(C({"type": "keywords", "include": ["very"]}), response)
    assert count_phrase(response, "very") == 1
    assert words(response) == ["This", "is", "very" if hidden != "ＶＥＲＹ" else "VERY", "good"]


def test_invisible_characters_do_not_count_words_sentences_or_lines() -> None:
    padded = "one\u200b two \u200bthree ve\u00adry"  # 4 words to a reader
    assert len(words(padded)) == 4
    assert check(C({"type": "word_count", "max": 4}), padded)
    assert not check(C({"type": "word_count", "min": 5}), padded)
    # A zero-width space after a full stop hid the end of the sentence; a line of one was not blank.
    assert len(sentences("One.\u200b Two.\u200b Three.")) == 3
    assert not check(C({"type": "sentence_count", "max": 1}), "One.\u200b Two.")
    assert len(paragraphs("First.\n\u200b\nSecond.\n\ufeff \n\nThird.")) == 3
    assert bullets("- milk\n- \u200b\n- \u00a0\n- eggs") == ["milk", "eggs"]  # an empty-looking bullet is none
    assert words("می\u200cخواهم") == ["میخواهم"]  # a Persian word with a non-joiner is one word
    assert check(C({"type": "quotation"}), '\u200b"Quoted."')
    assert check(C({"type": "starts_with", "phrase": "Sure"}), "\ufeffSure, here it is.")
    assert check(C({"type": "ends_with", "phrase": "That is all"}), "Done. That is a\u00adll.")


def test_compatibility_forms_read_as_what_they_stand_for() -> None:
    """The consequences of NFKC that the module docstring states, kind by kind."""
    assert words("ｄｏｎ＇ｔ ﬁne x² ①") == ["don't", "fine", "x2", "1"]
    assert len(words("½")) == 2 and words("Acme™") == ["AcmeTM"]  # "1⁄2"; the mark is letters
    assert count_phrase("the ﬁnal answer", "final") == 1 and count_phrase("x²", "2") == 0
    assert check(C({"type": "starts_with", "phrase": "Sure"}), "Ｓｕｒｅ！ Here it is.")
    assert check(C({"type": "ends_with", "phrase": "That is all"}), "Bye. Ｔｈａｔ ｉｓ ａｌｌ．")
    assert not check(C({"type": "no_commas"}), "Step 🄂 then stop")  # DIGIT ONE COMMA holds a comma
    # Sentences, case and json read the characters as written.
    assert len(sentences("你好！谢谢")) == 2
    assert check(C({"type": "case", "mode": "lower"}), "ᴴᴵ there")
    assert not check(C({"type": "json"}), '\ufeff{"a": 1}')


def test_look_alike_letters_of_other_scripts_stay_distinct() -> None:
    """No homoglyph folding: a Cyrillic "е" makes another word (a real multilingual answer writes Cyrillic)."""
    assert count_phrase("This is v\u0435ry good.", "very") == 0
    assert count_phrase("Это очень хорошо", "очень") == 1


def test_a_keyword_of_invisible_characters_only_is_refused() -> None:
    with pytest.raises(ValueError, match="must hold visible texts"):
        C({"type": "forbidden", "words": ["\u200b"]})
    with pytest.raises(ValueError, match="must hold visible texts"):
        C({"type": "keywords", "include": ["ok", "\u00ad\ufeff"]})


@pytest.mark.parametrize(
    "value",
    ["punctuation:no_comma", " startend:quotation\n", "['punctuation:no_comma', 'change_case:english_lowercase']"],
)
def test_bare_ifeval_ids_are_named(value: str) -> None:
    with pytest.raises(ValueError, match="IFEval's rows"):
        parse_constraints(value)
    res = InstructionReward().score(["answer"], [value])
    assert res.counters["bad_constraints"] == 1 and res.failed == [True]


@pytest.mark.parametrize("value", ["not json at all", "a: b", "type:word_count max:20"])
def test_other_text_is_still_not_json(value: str) -> None:
    with pytest.raises(ValueError, match="not JSON") as err:
        parse_constraints(value)
    assert IFEVAL_HINT not in str(err.value)
    assert parse_constraints(json.dumps([{"type": "no_commas"}])) == [{"type": "no_commas"}]
