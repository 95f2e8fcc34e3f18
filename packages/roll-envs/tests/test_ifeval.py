"""The instruction-following domain: each constraint checker by hand (passing, failing, edge cases), the reward's
scores and counters, the generated task (seeded, disjoint, constraints stated in the prompt, always satisfiable),
rows from files, and the env=instruct config composing and building."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from roll_core.errors import ConfigError
from roll_core.interfaces.tasks import reward_kwargs
from roll_core.testing.rewards import Case, RewardTestSuite
from roll_envs.rewards.ifeval import (
    KINDS,
    InstructionReward,
    bullets,
    check,
    describe,
    json_object,
    paragraphs,
    parse_constraints,
    sentences,
    validate_constraint,
    words,
)
from roll_envs.tasks.base import stable_fraction
from roll_envs.tasks.instruct import InstructTask, draw_constraints, satisfying_response


def test_words() -> None:
    assert words("") == [] and words("  ... --- !!! ") == []
    assert words("Don't stop: well-known ideas.") == ["Don't", "stop", "well-known", "ideas"]
    assert words("It’s 3.14, not 1,000 or 2.") == ["It’s", "3.14", "not", "1,000", "or", "2"]
    assert words("e.g. foo_bar a-b- -c 'quoted'") == ["e", "g", "foo", "bar", "a-b", "c", "quoted"]
    assert words("Élan über café, 向上 答案") == ["Élan", "über", "café", "向上", "答案"]
    assert words("- milk\n* eggs\n**bold**") == ["milk", "eggs", "bold"]
    assert words('{"answer": "the sea"}') == ["answer", "the", "sea"]


def test_sentences() -> None:
    assert sentences("") == [] and sentences("...!?") == []
    assert sentences("Hello world") == ["Hello world"]  # no end mark needed
    assert sentences("Hi. How are you?  Fine!") == ["Hi", "How are you", "Fine"]
    assert sentences("Pi is 3.14. Yes") == ["Pi is 3.14", "Yes"]  # no space after a decimal point: no end
    assert len(sentences('He said "go." Then left… Really?!')) == 3  # closing quote, ellipsis, mark runs
    assert len(sentences("Dr. Smith came.")) == 2  # no abbreviation list (documented)
    assert len(sentences("- one\n- two\n\nthree")) == 3  # every line break ends one
    assert len(sentences("你好。今天好！")) == 2


def test_paragraphs() -> None:
    assert paragraphs("") == [] and paragraphs("\n\n \n") == []
    assert paragraphs("one line\nsame paragraph") == ["one line\nsame paragraph"]
    assert paragraphs("a\n\nb\n \t\nc") == ["a", "b", "c"]
    assert paragraphs("a\n\n***\n\nb") == ["a", "b"]  # a separator without words is no paragraph


def test_bullets() -> None:
    text = "Intro:\n- milk\n  * eggs\n*\tbread\n**bold**\n-5 degrees\n---\n- - -\n- \n1. first\n-no space"
    assert bullets(text) == ["milk", "eggs", "bread"]
    assert bullets("") == [] and bullets("* a\r\n* b") == ["a", "b"]


def test_json_object() -> None:
    assert json_object('{"answer": "sea"}') == {"answer": "sea"}
    assert json_object('  ```json\n{"answer": 1}\n```  ') == {"answer": 1}
    assert json_object('```\n{"a": 1}```') == {"a": 1}
    for bad in ["", "[1, 2]", '"text"', 'Here: {"a": 1}', '{"a": 1} done', "```json\n{'a': 1}\n```", "[" * 100_000]:
        assert json_object(bad) is None, bad


def test_words_keep_their_combining_marks() -> None:
    """Vowel signs and viramas (Hindi, Thai) and decomposed accents are combining marks, which `\\w` leaves out: a
    word of those scripts fell apart into pieces ("नमस्ते दुनिया" was 5 words, "สวัสดีครับ" 4)."""
    assert words("नमस्ते दुनिया") == ["नमस्ते", "दुनिया"]
    assert words("สวัสดีครับ") == ["สวัสดีครับ"]  # Thai writes no spaces: one run, as Chinese
    assert words("cafe\u0301 noir") == ["caf\u00e9", "noir"]  # read composed (NFKC, module docstring)
    assert words("q\u0301 noir") == ["q\u0301", "noir"]  # no precomposed letter: the mark stays on the word
    assert check(C({"type": "word_count", "max": 2}), "नमस्ते दुनिया")
    # A keyword is a whole word: "ki" is not in "kílo" (decomposed), "नमस" not in "नमस्ते".
    assert not check(C({"type": "keywords", "include": ["ki"]}), "ki\u0301lo")
    assert not check(C({"type": "keywords", "include": ["नमस"]}), "नमस्ते दोस्त")
    assert check(C({"type": "forbidden", "words": ["नमस"]}), "नमस्ते दोस्त")
    assert check(C({"type": "keywords", "include": ["दुनिया"]}), "नमस्ते दुनिया।")
    assert not check(C({"type": "starts_with", "phrase": "Sure"}), "Sure\u0301ly")
    # The Devanagari danda and the Arabic question mark end sentences.
    assert sentences("नमस्ते। आप कैसे हैं? ठीक") == ["नमस्ते", "आप कैसे हैं", "ठीक"]
    assert len(sentences("كيف حالك؟ أنا بخير.")) == 2


def test_json_fences_as_the_reference_strips_them() -> None:
    """The reference IFEval check strips ```json / ```Json / ```JSON / ``` and a closing ``` with or without line
    breaks: a JSON answer in such a fence was unmet here."""
    assert json_object('```Json\n{"a": 1}\n```') == {"a": 1}
    assert json_object('```json {"a": 1}```') == {"a": 1}
    assert json_object('```JSON\n{"a": 1}```') == {"a": 1}
    assert json_object('```json\n{"a": 1}\n``` and more') is None  # still nothing outside the fence


C = validate_constraint
#: (constraint, response, met) by hand: every type met and unmet, with its edge cases.
CASES = [
    (C({"type": "word_count", "max": 3}), "one two three.", True),
    (C({"type": "word_count", "max": 3}), "one two three four", False),
    (C({"type": "word_count", "min": 2, "max": 3}), "don't stop", True),  # "don't" is one word
    (C({"type": "word_count", "count": 2}), "well-known 3.14", True),
    (C({"type": "word_count", "min": 2}), "!!! ??? ...", False),
    (C({"type": "word_count", "max": 5}), "   ", False),  # blank meets nothing, even "at most"
    (C({"type": "sentence_count", "count": 2}), "It rains. We stay in!", True),
    (C({"type": "sentence_count", "count": 2}), "It rains; we stay in.", False),
    (C({"type": "sentence_count", "max": 1}), "Pi is 3.14 today.", True),
    (C({"type": "paragraphs", "count": 2}), "First part.\n\nSecond part.", True),
    (C({"type": "paragraphs", "count": 2}), "First part.\nSecond part.", False),
    (C({"type": "bullets", "count": 3}), "Here:\n- a\n- b\n* c", True),
    (C({"type": "bullets", "count": 3}), "- a\n- b\n**c**", False),
    (C({"type": "bullets", "count": 2}), "1. a\n2. b", False),
    (C({"type": "keywords", "include": ["ocean"]}), "The OCEAN is wide.", True),
    (C({"type": "keywords", "include": ["ocean"]}), "Oceanic waves.", False),  # whole words only
    (C({"type": "keywords", "include": ["sea", "sky"]}), "The sea.", False),  # every one of them
    (C({"type": "keywords", "include": ["sea"], "min_count": 2}), "sea, Sea!", True),
    (C({"type": "keywords", "include": ["ice cream"], "min_count": 2}), "ice  cream, ice\ncream", True),
    (C({"type": "keywords", "include": ["ice cream"]}), "icecream", False),
    (C({"type": "keywords", "include": ["café"]}), "Un CAFÉ noir.", True),
    (C({"type": "forbidden", "words": ["very"]}), "Everything is fine.", True),  # not a whole word
    (C({"type": "forbidden", "words": ["just"]}), "A just-in-time plan.", True),  # part of one hyphenated word
    (C({"type": "keywords", "include": ["known"]}), "A well-known fact.", False),
    (C({"type": "keywords", "include": ["well-known"]}), "A well-known fact.", True),
    (C({"type": "forbidden", "words": ["don"]}), "I don't know.", True),
    (C({"type": "forbidden", "words": ["very"]}), "It is Very good.", False),
    (C({"type": "forbidden", "words": ["very"]}), "", False),
    (C({"type": "json", "keys": ["answer"]}), '```json\n{"answer": "blue"}\n```', True),
    (C({"type": "json", "keys": ["answer"]}), '{"Answer": "blue"}', False),  # keys are case-sensitive
    (C({"type": "json", "keys": ["answer"]}), 'Sure! {"answer": "blue"}', False),
    (C({"type": "json"}), "{}", True),
    (C({"type": "case", "mode": "lower"}), "all small, even ünïcode 123.", True),
    (C({"type": "case", "mode": "lower"}), "almost all small É", False),
    (C({"type": "case", "mode": "lower"}), "123 向上", False),  # no cased letter at all
    (C({"type": "case", "mode": "upper"}), "ALL CAPS ÉCOLE 42!", True),
    (C({"type": "case", "mode": "upper"}), "ALL CAPs", False),
    (C({"type": "starts_with", "phrase": "Sure"}), "  sure, here it is", True),
    (C({"type": "starts_with", "phrase": "Sure"}), "Surely not", False),
    (C({"type": "starts_with", "phrase": "Sure"}), "Sure", True),
    (C({"type": "ends_with", "phrase": "That is all"}), "Blue sky. that is all.\n", True),
    (C({"type": "ends_with", "phrase": "Any questions?"}), "Done. Any questions", True),  # end marks ignored
    (C({"type": "ends_with", "phrase": "all"}), "That is overall.", False),  # whole words
    (C({"type": "ends_with", "phrase": "That is all"}), "That is all. Bye.", False),
    (C({"type": "no_commas"}), "No commas here.", True),
    (C({"type": "no_commas"}), "One, two.", False),
    (C({"type": "no_commas"}), "全角，逗号", False),
    (C({"type": "quotation"}), '  "Quoted answer."  ', True),
    (C({"type": "quotation"}), "“Curly quotes”", True),
    (C({"type": "quotation"}), '""', False),
    (C({"type": "quotation"}), '"Open only', False),
]


@pytest.mark.parametrize(("constraint", "response", "met"), CASES, ids=[f"{c['type']}-{i}" for i, (c, *_) in
                                                                         enumerate(CASES)])  # fmt: skip
def test_checker_by_hand(constraint: dict, response: str, met: bool) -> None:
    assert check(constraint, response) is met


def test_every_type_has_met_and_unmet_cases_and_a_description() -> None:
    for kind in KINDS:
        outcomes = {met for c, _, met in CASES if c["type"] == kind}
        assert outcomes == {True, False}, kind
        assert describe(next(c for c, *_ in CASES if c["type"] == kind)).endswith(".")


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"type": "wordcount", "max": 3}, r"unknown constraint type 'wordcount'; known: word_count, sentence_count"),
        ("word_count", r"must be an object with a 'type'"),
        ({"max": 3}, r"unknown constraint type None"),
        ({"type": "word_count"}, r"needs 'count', 'min' or 'max'"),
        ({"type": "word_count", "max": -1}, r"'max' must be an integer >= 0, got -1"),
        ({"type": "word_count", "max": True}, r"'max' must be an integer"),
        ({"type": "word_count", "max": "20"}, r"'max' must be an integer"),
        ({"type": "word_count", "min": 5, "max": 2}, r"'min' 5 is above 'max' 2"),
        ({"type": "bullets", "count": 2, "max": 3}, r"either 'count' or 'min'/'max'"),
        ({"type": "bullets", "cont": 2}, r"'bullets' does not take \['cont'\]; it takes \['count', 'max', 'min'\]"),
        ({"type": "keywords"}, r"'keywords' lacks \['include'\]"),
        ({"type": "keywords", "include": []}, r"'include' must be a non-empty list"),
        ({"type": "keywords", "include": "ocean"}, r"'include' must be a non-empty list"),
        ({"type": "keywords", "include": ["ok", " "]}, r"must hold non-empty texts"),
        ({"type": "keywords", "include": ["ok"], "min_count": 0}, r"'min_count' must be an integer >= 1"),
        ({"type": "case", "mode": "title"}, r"'mode' must be 'lower' or 'upper'"),
        ({"type": "starts_with", "phrase": "..."}, r"'phrase' must be text holding a word"),
        ({"type": "no_commas", "strict": True}, r"does not take \['strict'\]; it takes no arguments"),
    ],
)
def test_bad_constraints_are_refused_with_the_reason(constraint: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_constraint(constraint)


def test_parse_constraints() -> None:
    rows = [{"type": "no_commas"}, {"type": "case", "mode": "lower"}]
    assert parse_constraints(rows) == parse_constraints(json.dumps(rows)) == rows
    for bad, message in [("[]", "non-empty list"), ("{", "not JSON"), ('{"type": "json"}', "non-empty list")]:
        with pytest.raises(ValueError, match=message):
            parse_constraints(bad)


FOUR = [
    {"type": "word_count", "max": 5},
    {"type": "keywords", "include": ["sea"]},
    {"type": "case", "mode": "lower"},
    {"type": "no_commas"},
]


def test_reward_scores_the_fraction_met_and_counts_what_failed() -> None:
    responses = ["the sea is calm.", "The sea, calm.", "The Sea, so very very calm today.", "   ", "fine", "ok"]
    answers = [json.dumps(FOUR)] * 4 + ['[{"type": "nope"}]', "not json"]
    res = InstructionReward().score(responses, answers)
    assert res.scores == [1.0, 0.5, 0.25, 0.0, 0.0, 0.0]
    assert res.correct == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert res.formatted == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert res.counters == {
        "bad_constraints": 2,
        "empty_response": 1,
        "check_errors": 0,
        "unmet_word_count": 2,
        "unmet_keywords": 1,
        "unmet_case": 3,
        "unmet_no_commas": 3,
    }
    strict = InstructionReward(all_or_nothing=True).score(responses, answers)
    assert strict.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and strict.correct == res.correct


def test_a_thinking_models_reasoning_is_not_held_to_the_constraints() -> None:
    """Qwen3's reply starts with its <think> block: the constraints are met (or not) by the answer after it. The
    reasoning's capitals, commas and words scored a correct lowercase JSON answer 0; a reply cut off inside its
    reasoning has no answer (blank: nothing met, not formatted)."""
    constraints = json.dumps([*FOUR[:1], {"type": "json", "keys": ["sea"]}, *FOUR[2:]])
    reasoning = "<think>\nThe user wants JSON, all lowercase, without commas. Let me write it.\n</think>\n\n"
    responses = [reasoning + '{"sea": "calm"}', '{"sea": "calm"}', "<think>\nThe user wants JSON, so", reasoning]
    res = InstructionReward().score(responses, [constraints] * 4)
    assert res.scores == [1.0, 1.0, 0.0, 0.0]
    assert res.correct == [1.0, 1.0, 0.0, 0.0]
    assert res.formatted == [1.0, 1.0, 0.0, 0.0]
    assert res.counters["empty_response"] == 2


def test_rows_with_bad_constraints_are_failed_not_wrong() -> None:
    """A row whose constraints are missing or malformed was not judged: `failed`, which the reward guard counts in
    failed_unscored, so a data set whose constraints never arrive stops the run (it trained on 0 for every row)."""
    from roll_core.cluster.reward_guard import GuardedReward, all_rows_failed

    answers = [json.dumps(FOUR), '[{"type": "nope"}]', "not json", ""]
    res = InstructionReward().score(["the sea is calm."] * 4, answers)
    assert res.failed == [False, True, True, True] and res.counters["bad_constraints"] == 3
    guarded = GuardedReward(InstructionReward(), isolation="inline").score(["a", "b"], ["", "[oops"])
    assert all_rows_failed(guarded.counters) and guarded.counters["failed_unscored"] == 2


def test_reward_reads_metadata_before_the_answer() -> None:
    reward = InstructionReward()
    upper = [{"type": "case", "mode": "upper"}]
    metadata = [{"constraints": upper, "domain": "instruct"}, {"domain": "instruct"}, {"constraints": "[oops"}]
    answers = [json.dumps(FOUR), json.dumps(upper), json.dumps(upper)]  # row 1 falls back to its answer
    # What the reward role passes: metadata (declared), never prompts (not declared).
    assert list(reward_kwargs(reward, prompts=["p"] * 3, metadata=metadata)) == ["metadata"]
    res = reward.score(["LOUD", "LOUD", "LOUD"], answers, metadata=metadata)
    assert res.scores == [1.0, 1.0, 0.0] and res.counters["bad_constraints"] == 1
    with pytest.raises(ValueError, match="2 metadata rows"):
        reward.score(["a", "b", "c"], answers, metadata=metadata[:2])


class TestInstructionReward(RewardTestSuite):
    """The reward contract (roll_core.testing.rewards). The first correct case asks for a word, so none of the
    suite's malformed responses can meet it by chance."""

    reward_class = InstructionReward
    cases = (
        Case("the ocean is calm", json.dumps([{"type": "keywords", "include": ["ocean"]}, FOUR[2]]), correct=True),
        Case('```json\n{"answer": "blue"}\n```', json.dumps([{"type": "json", "keys": ["answer"]}]), correct=True),
        Case("- a\n- b", json.dumps([{"type": "bullets", "count": 3}]), correct=False),
        Case("The Ocean", json.dumps([{"type": "keywords", "include": ["ocean"]}, FOUR[2]]), correct=False),
    )


def test_generated_task_is_seeded_disjoint_and_states_its_constraints() -> None:
    reward = InstructionReward()
    a, b = InstructTask(reward, train_size=300, eval_size=60), InstructTask(reward, train_size=300, eval_size=60)
    other = InstructTask(reward, train_size=300, eval_size=60, seed=1)
    assert [(p.id, p.prompt) for p in a.train_set()] == [(p.id, p.prompt) for p in b.train_set()]
    assert [p.id for p in a.eval_set()] == [p.id for p in b.eval_set()]
    assert [p.id for p in a.train_set()] != [p.id for p in other.train_set()]
    train = {p.id for t in (a, other) for p in t.train_set()}
    held = {p.id for t in (a, other) for p in t.eval_set()}
    assert not train & held  # disjoint across seeds too: the split is a hash of the problem
    assert len({p.id for p in a.train_set()}) == 300  # distinct problems
    counts = {len(p.metadata["constraints"]) for p in a.train_set()}
    assert counts == {1, 2, 3}
    for p in [*a.train_set(), *a.eval_set()]:
        constraints = p.metadata["constraints"]
        assert p.domain == "instruct" and json.loads(p.answer) == constraints
        assert all(describe(c) in p.prompt for c in constraints)  # stated in plain words
        response = satisfying_response(constraints)
        assert all(check(c, response) for c in constraints), (p.prompt, response)
    res = reward.score([satisfying_response(p.metadata["constraints"]) for p in a.eval_set()],
                       [p.answer for p in a.eval_set()])  # fmt: skip
    assert res.correct == [1.0] * 60


def test_generated_task_types_and_counts_are_checked() -> None:
    reward = InstructionReward()
    task = InstructTask(reward, types=["case", "keywords"], min_constraints=2, max_constraints=2, train_size=50)
    assert all([c["type"] for c in p.metadata["constraints"]] == ["keywords", "case"] for p in task.train_set())
    with pytest.raises(ConfigError, match=r"env.types=\['case', 'nope'\]: unknown or none \(\['nope'\]\)"):
        InstructTask(reward, types=["case", "nope"])
    with pytest.raises(ConfigError, match="need 1 <= min <= max"):
        InstructTask(reward, min_constraints=3, max_constraints=2)
    with pytest.raises(ValueError, match="cannot draw 5 training problems"):  # two conflicting types, two each
        InstructTask(reward, types=["json", "bullets"], min_constraints=2, train_size=5)
    drawn = draw_constraints(random.Random(0), ["json", "bullets", "quotation"], 3)
    assert len(drawn) == 1  # every pair of these conflicts


def _write(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_rows_from_a_file(tmp_path: Path) -> None:
    rows = [
        {"prompt": f"Describe item {i} in lowercase.", "constraints": [{"type": "case", "mode": "lower"}], "tag": i}
        for i in range(40)
    ]
    rows[3]["constraints"] = json.dumps(rows[3]["constraints"])  # JSON text (a Parquet string column)
    rows[5]["domain"] = "style"
    path = _write(tmp_path / "rows.jsonl", [*rows, {"prompt": " ", "constraints": []}, "not json", [1]])
    task = InstructTask(InstructionReward(), path=path, eval_fraction=0.25)
    problems = sorted([*task.train_set(), *task.eval_set()], key=lambda p: int(p.id.rsplit(":", 1)[1]))
    assert len(problems) == 40 and task.eval_set() and task.train_set()
    assert task.skipped_rows == {path: 3} and [n for _, n, _ in task.skipped] == [41, 42, 43]
    assert problems[3].metadata == {"tag": 3, "constraints": [{"type": "case", "mode": "lower"}]}
    assert problems[5].domain == "style" and problems[0].domain == "instruct"
    assert {p.prompt for p in task.train_set()}.isdisjoint(p.prompt for p in task.eval_set())
    res = task.reward.score(["fine", "Fine"], [problems[0].answer] * 2, metadata=[problems[0].metadata] * 2)
    assert res.correct == [1.0, 0.0]

    bad = [*rows[:2], {"prompt": "x", "constraints": [{"type": "word_count", "most": 3}]}]
    with pytest.raises(ConfigError, match=r"bad\.jsonl line 3: bad 'constraints': constraint 'word_count' does not "):
        InstructTask(InstructionReward(), path=_write(tmp_path / "bad.jsonl", bad))
    with pytest.raises(ConfigError, match=r"none\.jsonl line 2: no 'constraints' column"):
        InstructTask(InstructionReward(), path=_write(tmp_path / "none.jsonl", [rows[0], {"prompt": "x"}]))
    with pytest.raises(ConfigError, match=r"does not exist: check env\.eval_path"):
        InstructTask(InstructionReward(), path=path, eval_path=str(tmp_path / "missing.jsonl"))


def test_whitespace_twins_of_held_out_rows_are_left_out_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """env=file's rule: a training row that is a held-out row's prompt but for whitespace is left out, logged, and
    counted in `also_held_out` (held_out_split was called without `counts`: the count stayed 0)."""
    lower = [{"type": "case", "mode": "lower"}]
    prompts = [f"Describe item {i} in lowercase." for i in range(60)]
    rows = [{"prompt": p, "constraints": lower} for p in prompts]
    rows += [{"prompt": p + "\n", "constraints": lower} for p in prompts]  # twins: a trailing newline
    path = _write(tmp_path / "rows.jsonl", rows)
    with caplog.at_level("WARNING"):
        task = InstructTask(InstructionReward(), path=path, eval_fraction=0.25, eval_size=1000)
    held = {" ".join(p.prompt.split()) for p in task.eval_set()}
    assert held and not held & {" ".join(p.prompt.split()) for p in task.train_set()}
    dropped = 120 - len(task.train_set()) - len(task.eval_set())
    assert dropped > 0 and task.also_held_out == dropped
    assert f"{dropped} of its 120 rows repeat a held-out row's prompt but for whitespace" in caplog.text
    # env.eval_path: its rows' training twins are counted the same way.
    bench = _write(tmp_path / "bench.jsonl", [{"prompt": p + "  ", "constraints": lower} for p in prompts[:7]])
    with_bench = InstructTask(InstructionReward(), path=path, eval_path=bench)
    assert with_bench.also_held_out == 14 and len(with_bench.train_set()) == 106


def test_skipped_rows_of_a_file_are_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As env=file does: the rows were counted in the summary, but nothing said so while the task loaded."""
    row = {"prompt": "Describe the sea in lowercase.", "constraints": [{"type": "case", "mode": "lower"}]}
    path = _write(tmp_path / "rows.jsonl", [row, {"prompt": "", "constraints": []}, "not json"])
    with caplog.at_level("WARNING"):
        InstructTask(InstructionReward(), path=path, eval_fraction=0.0)
    assert f"{path}: skipped 2 bad row(s): line 2: missing or empty 'prompt'; line 3: invalid JSON" in caplog.text


def test_rows_with_lone_surrogates_or_a_templated_prompt_are_counted_skips(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As env=file reads rows: a prompt already chat-templated was templated again, and a `\\ud800` escape in the
    constraints (a keyword no response can hold; also in constraints given as JSON text, as a Parquet column holds
    them) or in another column (kept in the metadata the reward and the sample dumps encode) loaded silently. Each
    is a counted skip naming the line, logged."""
    lower = [{"type": "case", "mode": "lower"}]
    rows: list = [{"prompt": f"Describe item {i} in lowercase.", "constraints": lower} for i in range(8)]
    rows[1] = {"prompt": "<|im_start|>user\nDescribe it.<|im_end|>\n", "constraints": lower}
    rows[2] = {"prompt": "Use a word.", "constraints": [{"type": "keywords", "include": ["ri\ud800ver"]}]}
    rows[3] = {"prompt": "Use a word.", "constraints": json.dumps([{"type": "keywords", "include": ["s\udc80"]}])}
    rows[4] = {"prompt": "Describe it.", "constraints": lower, "tags": ["ok", "b\udfffd"]}
    rows[5] = {"prompt": [{"role": "system", "content": "<|system|>Be brief."}, {"role": "user", "content": "Hi."}]}
    rows[5]["constraints"] = lower
    path = _write(tmp_path / "rows.jsonl", rows)  # (json.dumps writes the \ud800 escapes)
    with caplog.at_level("WARNING"):
        task = InstructTask(InstructionReward(), path=path, eval_fraction=0.0)
    assert sorted(p.id for p in task.train_set()) == [f"instruct:rows.jsonl:{n}" for n in (1, 7, 8)]
    escape = "is not valid Unicode text (a lone surrogate \\u{} at character {}, a broken \\u escape)"
    fix = "and would be templated again: give the raw user text, or chat messages as a list of {role, content}"
    assert [(n, why) for _, n, why in task.skipped] == [
        (2, f"'prompt' is already chat-templated (it opens with '<|im_start|>') {fix}"),
        (3, f"column 'constraints'[0]['include'][0] {escape.format('d800', 2)}"),
        (4, f"column 'constraints'[0]['include'][0] {escape.format('dc80', 1)}"),
        (5, f"column 'tags'[1] {escape.format('dfff', 1)}"),
        (6, f"message 0 of 'prompt' is already chat-templated (it opens with '<|system|>') {fix}"),
    ]
    assert task.skipped_rows == {path: 5}
    assert f"{path}: skipped 5 bad row(s): line 2: 'prompt' is already" in caplog.text


def test_env_instruct_composes_and_builds(tmp_path: Path) -> None:
    """`roll-train env=instruct ...` and `env=file env/reward=ifeval` as Hydra composes them (env node only: the
    rest of the run config is not this domain's)."""
    from roll_core.config import compose
    from roll_core.config.build import build
    from roll_core.config.compose import to_object
    from roll_envs.tasks.instruct import InstructEnvConfig

    overrides = ["env=instruct", "env.train_size=20", "env.types=[keywords,case]", "env.reward.all_or_nothing=true"]
    env = to_object(compose(overrides).env)
    assert type(env) is InstructEnvConfig
    task = build(env)
    assert type(task) is InstructTask and task.reward.all_or_nothing is True and len(task.train_set()) == 20
    assert {c["type"] for p in task.train_set() for c in p.metadata["constraints"]} <= {"keywords", "case"}
    with pytest.raises(ConfigError, match="unknown or none"):
        InstructEnvConfig(types=["keyword"])
    with pytest.raises(ValueError, match=r"env\.eval_fraction=1\.5 must be in"):
        InstructEnvConfig(eval_fraction=1.5)
    # A data file of env=file with a constraints column, scored by this reward through the row's metadata.
    rows = [{"prompt": f"Say hi {i}.", "answer": "-", "constraints": FOUR} for i in range(9)]
    path = _write(tmp_path / "d.jsonl", rows)
    file_task = build(to_object(compose(["env=file", f"env.path={path}", "env/reward=ifeval"]).env))
    p = file_task.train_set()[0]
    res = file_task.reward.score(["the sea is calm", "the sea is calm"], [p.answer] * 2, metadata=[p.metadata, {}])
    assert res.correct == [1.0, 0.0] and res.counters["bad_constraints"] == 1  # "-" is no constraint list


def test_held_out_split_is_a_hash_of_the_problem() -> None:
    task = InstructTask(InstructionReward(), train_size=100, eval_size=20, eval_fraction=0.3)
    for p in task.eval_set():
        request = p.prompt.split(". ")[0] + "."
        key = request + json.dumps(p.metadata["constraints"], sort_keys=True)
        assert stable_fraction(key) < 0.3


def test_the_conformance_instance_is_never_met_by_garbage(tmp_path: Path) -> None:
    """The task suite scores malformed responses against one held-out problem: the conformance instance draws only
    types garbage cannot meet, on every problem (with all types, "x" * 100000 meets "at most 20 words")."""
    from roll_core.testing.tasks import MALFORMED

    task = InstructTask.conformance_task(0, tmp_path)
    problems = task.eval_set()
    for response in MALFORMED:
        assert InstructionReward().score([response] * len(problems), [p.answer for p in problems]).correct == [
            0.0
        ] * len(problems), response[:30]
    assert check({"type": "word_count", "max": 20}, MALFORMED[3])
