"""A first or last phrase, and a keyword, match whole words as `words` reads them: an apostrophe or hyphen between
letters, or a `.`/`,` between digits, joins one word ("don't", "over-all", "3.14"). starts_with and ends_with
stopped a match only between two letters, so "Don't worry." started with "Don" and "It is over-all." ended with
"all", while keywords refused "known" in "well-known"; a keyword "3" was found in "3.14"."""

from __future__ import annotations

import pytest

from roll_envs.rewards.ifeval import check, count_phrase, validate_constraint, words


@pytest.mark.parametrize(
    ("kind", "phrase", "response", "met"),
    [
        ("starts_with", "Don", "Don't worry.", False),
        ("starts_with", "Sure", "Sure-fire answer.", False),
        ("starts_with", "Yes", '"Yes-man is a word."', False),  # inside the quotes as well
        ("starts_with", "Well", "Well’s water is cold.", False),
        ("starts_with", "3", "3.14 is pi.", False),
        ("ends_with", "all", "It is over-all.", False),
        ("ends_with", "The end", "Not the-The end", False),
        ("ends_with", "14", "Pi is 3.14", False),
        # Separators that join nothing still part words.
        ("starts_with", "Sure", "Sure - here it is.", True),
        ("starts_with", "Sure", "Sure—here it is.", True),
        ("starts_with", "Sure", "Sure, it is.", True),
        ("starts_with", "Don", "Don' is not a word.", True),
        ("starts_with", "Sure", "Sure'", True),
        ("ends_with", "That is all", "Bye - That is all.", True),
        ("ends_with", "all", "It is all.", True),
        ("ends_with", "14", "Pi is 3. 14", True),
        ("starts_with", "Don't", "Don't worry.", True),
        ("ends_with", "over-all", "It is over-all.", True),
    ],
)
def test_a_first_or_last_phrase_is_whole_words(kind: str, phrase: str, response: str, met: bool) -> None:
    assert check(validate_constraint({"type": kind, "phrase": phrase}), response) is met


@pytest.mark.parametrize("response", ["Don't worry.", "Sure-fire.", "Well’s fine.", "3.14 it is.", "Sure, 3,5."])
def test_a_met_first_phrase_is_the_first_words(response: str) -> None:
    """The verdict agrees with `words`: every prefix of the response that starts_with accepts is its first words."""
    first = [w.casefold() for w in words(response)]
    for end in range(1, len(response) + 1):
        phrase = response[:end]
        if not words(phrase):
            continue
        met = check(validate_constraint({"type": "starts_with", "phrase": phrase}), response)
        prefix = [w.casefold() for w in words(phrase)]
        if met:
            assert first[: len(prefix)] == prefix, phrase


def test_a_keyword_number_is_a_whole_number() -> None:
    assert count_phrase("Pi is 3.14, not 3, and 1,000 is 1000.", "3") == 1
    assert count_phrase("3.14 and 3,5", "14") == 0
    assert count_phrase("3.14 and 3. 14", "14") == 1
    assert count_phrase("Pi is 3.14.", "3.14") == 1
    assert count_phrase("version 2.0-beta", "2.0") == 0  # "2.0-beta" is one word
