"""Edge cases where the ifeval reward read a response or a row differently from the reference IFEval
(google-research instruction_following_eval) without saying so: a quoted answer's last phrase, titlecase letters,
decomposed accents, null fields of Parquet constraint structs, IFEval-format rows, no-break-space blank lines.
Deliberate, documented differences (whole-word keywords, "don't" one word, inclusive bounds) are not here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_core.errors import ConfigError
from roll_envs.rewards.ifeval import InstructionReward, check, paragraphs, parse_constraints, validate_constraint
from roll_envs.tasks.instruct import InstructTask

C = validate_constraint


@pytest.mark.parametrize(
    "response",
    [
        '"The sky is blue. Is there anything else I can help with?"',
        "“Blue, and calm. Is there anything else I can help with?”",
        '  "Blue. Is there anything else I can help with"  \n',
    ],
)
def test_a_quoted_answer_still_ends_with_its_phrase(response: str) -> None:
    """IFEval's end check strips the double quotes around the response, so an answer wrapped in quotes (IFEval
    draws startend:quotation and startend:end_checker together) can meet both: here the pair could never be met
    together, a row holding both scored at most 1/2."""
    end = C({"type": "ends_with", "phrase": "Is there anything else I can help with?"})
    assert check(end, response)
    both = [{"type": "quotation"}, dict(end)]
    assert InstructionReward().score([response], [json.dumps(both)]).scores == [1.0]
    assert not check(end, '"Is there anything else I can help with? No."')  # still the end of the answer
    assert check(C({"type": "starts_with", "phrase": "Sure"}), '"Sure, it is blue."')  # same for the start
    assert not check(C({"type": "starts_with", "phrase": "Sure"}), '"Surely blue."')
    # A phrase that ends in a quote itself is still met by a response ending with it.
    assert check(C({"type": "ends_with", "phrase": 'he said "yes"'}), 'And he said "yes"')


def test_a_titlecase_letter_is_neither_lowercase_nor_uppercase() -> None:
    """IFEval's case checks are str.islower / str.isupper, which a titlecase letter ("ǅ", "ǈ") fails: it met both
    "lower" and "upper" here."""
    assert not check(C({"type": "case", "mode": "lower"}), "all small but ǅ")
    assert not check(C({"type": "case", "mode": "upper"}), "ALL CAPS BUT ǅ")
    assert check(C({"type": "case", "mode": "lower"}), "all small ǆ")  # its lowercase form is lowercase


def test_decomposed_accents_are_the_same_words() -> None:
    """A keyword typed with a combining accent ("cafe" + U+0301) never matched the precomposed "café" a model
    writes (nor the reverse): the keyword was unmet, the forbidden word went unseen."""
    nfd, nfc = "cafe\u0301", "caf\u00e9"
    assert check(C({"type": "keywords", "include": [nfd]}), f"Un {nfc} noir.")
    assert check(C({"type": "keywords", "include": [nfc]}), f"Un {nfd} noir.")
    assert not check(C({"type": "forbidden", "words": [nfd]}), f"Un {nfc} noir.")
    assert check(C({"type": "starts_with", "phrase": nfd}), f"{nfc} au lait")
    assert check(C({"type": "ends_with", "phrase": nfc}), f"Un {nfd}.")


def test_null_arguments_of_other_types_are_absent(tmp_path: Path) -> None:
    """A Parquet (or Arrow) list of constraint structs gives every constraint every field of the list, null where
    another type's field is: a file mixing two types was refused ("'word_count' does not take ['include']")."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    constraints = [{"type": "word_count", "max": 20}, {"type": "keywords", "include": ["sea"]}]
    rows = [{"prompt": f"Describe sea {i}. Use the word sea, in at most 20 words.", "constraints": constraints}
            for i in range(5)]  # fmt: skip
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    task = InstructTask(InstructionReward(), path=str(path), eval_fraction=0.0)
    problem = task._train[0]
    assert problem.metadata["constraints"] == constraints and json.loads(problem.answer) == constraints
    assert InstructionReward().score(["The sea is calm."], [problem.answer]).scores == [1.0]
    # A null is "absent", so a required argument given as null is still missing, and an unknown key still refused.
    for bad, message in [
        ({"type": "keywords", "include": None}, r"lacks \['include'\]"),
        ({"type": "word_count", "max": None}, r"needs 'count', 'min' or 'max'"),
        ({"type": "word_count", "max": 3, "maxx": None}, r"does not take \['maxx'\]"),
        ({"type": None}, r"unknown constraint type None"),
    ]:
        with pytest.raises(ValueError, match=message):
            validate_constraint(bad)


def test_rows_in_ifevals_format_are_refused_saying_so(tmp_path: Path) -> None:
    """google/IFEval's rows (`instruction_id_list`, `kwargs`) were refused as a missing column or "a constraint must
    be an object": the error now says that IFEval's ids are not read, at load and in the reward."""
    row = {
        "key": 1,
        "prompt": "Write a haiku. Answer with less than 20 words.",
        "instruction_id_list": ["length_constraints:number_words"],
        "kwargs": [{"num_words": 20, "relation": "less than"}],
    }
    path = tmp_path / "ifeval.jsonl"
    path.write_text(json.dumps(row) + "\n")
    for key in ["constraints", "instruction_id_list"]:
        with pytest.raises(ConfigError, match=r"IFEval's rows .* are not read"):
            InstructTask(InstructionReward(), path=str(path), constraints_key=key)
    truth = json.dumps({"instruction_id": ["punctuation:no_comma"], "kwargs": [None]})  # open-instruct's shape
    with pytest.raises(ValueError, match=r"IFEval's rows .* are not read"):
        parse_constraints(truth)
    res = InstructionReward().score(["no commas here"], [truth])
    assert res.failed == [True] and res.counters["bad_constraints"] == 1


def test_a_blank_line_may_hold_a_no_break_space() -> None:
    """A paragraph ends at a line that is whitespace only; a no-break space (U+00A0) is whitespace, but such a
    line joined its two paragraphs into one."""
    assert paragraphs("First part.\n\u00a0\nSecond part.") == ["First part.", "Second part."]
    assert check(C({"type": "paragraphs", "count": 2}), "First part.\n \u00a0\t\nSecond part.")
    assert paragraphs("one line\nsame paragraph") == ["one line\nsame paragraph"]
