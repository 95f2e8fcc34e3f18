"""Verdicts of the ifeval checkers that contradicted the module's own rules or an obvious reading: keywords
compared without full case folding (unlike starts_with/ends_with), commas of other scripts, whitespace runs in a
first or last phrase, another script's sentence end after a last phrase; and the generator, which never drew
quotation marks with a first or last phrase although both can be met."""

from __future__ import annotations

import json
import random

import pytest

from roll_envs.rewards.ifeval import COMMAS, InstructionReward, check, count_phrase, validate_constraint
from roll_envs.tasks.instruct import InstructTask, draw_constraints, satisfying_response

C = validate_constraint


def test_keywords_fold_case_as_starts_with_does() -> None:
    """ "straße" is "STRASSE" in all capitals (`str.upper`); the keyword match used re.IGNORECASE (simple case
    folding) and missed it, while starts_with (str.casefold) matched: a required keyword was unmet by an
    all-capitals answer, a forbidden one went unseen."""
    assert count_phrase("Die STRASSE ist lang, die Straße auch.", "straße") == 2
    assert count_phrase("die Straße", "STRASSE") == 1
    assert count_phrase("die Strassen", "straße") == 0  # still whole words
    assert not check(C({"type": "forbidden", "words": ["straße"]}), "DIE STRASSE")
    # A dotted capital I stays an i (casefold makes "İ" an "i" and a combining dot).
    assert count_phrase("İstanbul and ISTANBUL", "istanbul") == 2
    assert count_phrase("istanbul", "İstanbul") == 1
    both = [{"type": "keywords", "include": ["straße"]}, {"type": "case", "mode": "upper"}]
    response = satisfying_response(both)
    assert "STRASSE" in response
    assert InstructionReward().score([response], [json.dumps(both)]).scores == [1.0]


@pytest.mark.parametrize(
    "response",
    ["はい、そうです", "نعم، شكرا", "Да﹐ да", "Yes，sure", "Yes, sure", "是的､好"],
)
def test_a_comma_of_any_script_breaks_no_commas(response: str) -> None:
    """The ideographic comma (Japanese's only comma) and the Arabic comma are commas; only `,` and `，` were."""
    assert not check(C({"type": "no_commas"}), response)


def test_no_commas_keeps_letters_shaped_like_commas() -> None:
    assert check(C({"type": "no_commas"}), "Hawaiʻi is 3.14 miles away。")  # ʻ is a letter (okina)
    assert {",", "，", "、", "،", "﹐"} <= COMMAS and "ʻ" not in COMMAS and "‚" not in COMMAS  # ‚: a quote


@pytest.mark.parametrize(
    ("kind", "phrase", "response", "near_miss"),
    [
        ("starts_with", "My answer is", "My  answer is yes.", "My  answers are yes."),
        ("starts_with", "My answer is", "My\nanswer is yes.", "My\n\nanswer isn't."),
        ("starts_with", "My  answer is", "My answer is yes.", "Myanswer is yes."),
        ("ends_with", "Have a nice day", "Bye. Have a nice\n  day!", "Bye. Have a nice\n  days!"),
        ("ends_with", "Thank  you", "Thank you.", "Thank youth."),
    ],
)
def test_a_whitespace_run_reads_as_one_space(kind: str, phrase: str, response: str, near_miss: str) -> None:
    """Keywords read a whitespace run as one space; a first or last phrase did not (a double space, invisible in
    the rendered answer, failed starts_with)."""
    assert check(C({"type": kind, "phrase": phrase}), response)
    assert not check(C({"type": kind, "phrase": phrase}), near_miss)


@pytest.mark.parametrize(
    ("phrase", "response", "met"),
    [
        ("谢谢", "好的。谢谢。", True),
        ("Thank you", "Bye. Thank you…", True),
        ("धन्यवाद", "ठीक है। धन्यवाद।", True),
        ("شكرا", "نعم شكرا؟", True),
        ("Thank you", "Bye. Thank you.)", False),  # only sentence-ending punctuation may follow the phrase
        ("Thank you", "Bye. Thank you 🙂", False),
    ],
)
def test_ends_with_ignores_every_sentence_end(phrase: str, response: str, met: bool) -> None:
    """ "Thank you." ended with "Thank you" but "谢谢。" not with "谢谢": only `.`, `!`, `?` were ignored."""
    assert check(C({"type": "ends_with", "phrase": phrase}), response) is met


def test_quotation_is_drawn_with_a_first_and_last_phrase() -> None:
    """Both phrases are read inside the quotes around the answer, so the generator may draw them together (IFEval
    does); it never did, as if they conflicted."""
    types = ["quotation", "starts_with", "ends_with"]
    for seed in range(5):
        assert sorted(c["type"] for c in draw_constraints(random.Random(seed), types, 3)) == sorted(types)
    task = InstructTask(InstructionReward(), types=types, min_constraints=3, train_size=20, eval_size=5)
    problems = [*task.train_set(), *task.eval_set()]
    assert len(problems) == 25
    res = task.reward.score(
        [satisfying_response(p.metadata["constraints"]) for p in problems], [p.answer for p in problems]
    )
    assert res.correct == [1.0] * 25
