"""Data rows whose text is not what it seems: a `\\ud800` escape (valid JSON, no Unicode character). A `.jsonl` file
that holds one JSON array of rows: test_tasks.py, with its `.json` twin."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from roll_core.errors import ConfigError
from roll_envs.rewards.math import MathReward
from roll_envs.tasks import FileTask, load_problems
from roll_envs.tasks.code import load_code_problems


def test_rows_with_a_lone_surrogate_escape_are_counted_skips(tmp_path: Path) -> None:
    """A `\\ud800` escape (text cut in the middle of a UTF-16 pair, then dumped as JSON) loaded as a prompt no
    encoder takes: FileTask ended in a bare UnicodeEncodeError from the held-out hash, naming neither file nor row,
    and in an answer or a chat turn it reached the tokenizer (TypeError) or the grader mid-run."""
    good = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    chat = [{"role": "system", "content": "Box it \ud83d."}, {"role": "user", "content": "What is 2 + 2?"}]
    rows = [
        good[0],
        {"prompt": "What is \udc80 + 1?", "answer": "2"},
        good[1],
        {"prompt": "What is 3 + 1?", "answer": "4\ud800"},
        {"prompt": chat, "answer": "4"},
        {"prompt": "What is 5 + 1?", "answer": "6", "domain": "geo\udfff"},
        # A proper pair (an emoji written as two escapes) is one character: the row is good.
        {"prompt": "What is \ud83d\ude00 + 1?", "answer": "7"},
        *good[2:],
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # (json.dumps writes the \ud800 escapes)

    task = FileTask(MathReward(), path=str(path), eval_fraction=0.0)

    assert [p.prompt for p in task.train_set()] == [
        "What is 0 + 1?",
        "What is 1 + 1?",
        "What is \U0001f600 + 1?",
        *(f"What is {i} + 1?" for i in range(2, 8)),
    ]
    assert [(n, why) for _, n, why in task.skipped] == [
        (2, "'prompt' is not valid Unicode text (a lone surrogate \\udc80 at character 8, a broken \\u escape)"),
        (4, "'answer' is not valid Unicode text (a lone surrogate \\ud800 at character 1, a broken \\u escape)"),
        (
            5,
            "message 0 of 'prompt' is not valid Unicode text (a lone surrogate \\ud83d at character 7, a broken "
            "\\u escape)",
        ),
        (6, "'domain' is not valid Unicode text (a lone surrogate \\udfff at character 3, a broken \\u escape)"),
    ]
    assert task.skipped_rows == {str(path): 4}

    # The code task reads prompts with the same checks.
    code = tmp_path / "code.jsonl"
    tests = [{"input": "1", "output": "1"}]
    code.write_text("".join(json.dumps({"prompt": p, "tests": tests}) + "\n" for p in ["Echo it.", "Echo \ud800 it."]))
    problems, skipped = load_code_problems(code)
    assert [p.prompt for p in problems] == ["Echo it."]
    assert [n for n, _ in skipped] == [2] and "lone surrogate \\ud800" in skipped[0][1]


def test_rows_with_a_lone_surrogate_in_another_column_are_counted_skips(tmp_path: Path) -> None:
    """The row's other columns (its metadata: test cases, constraints, tags) reach rewards, the distillation
    teacher's prompt and the samples written to disk: a `\\ud800` escape there loaded silently and failed mid-run
    wherever they were encoded."""
    rows = [
        {"prompt": "What is 1 + 1?", "answer": "2", "source": "gsm8k"},
        {"prompt": "What is 2 + 1?", "answer": "3", "source": "gsm\ud800k"},
        {"prompt": "What is 3 + 1?", "answer": "4", "extra": {"tags": ["ok", "b\udc80d"]}},
        {"prompt": "What is 4 + 1?", "answer": "5", "extra": {"k\ud83d": 1}},
        {"prompt": "What is 5 + 1?", "answer": "6", "c\udfff": 1},
        {"prompt": "What is 6 + 1?", "answer": "7", "reward_model": {"style": "rule", "ground_truth": "7"}},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # (json.dumps writes the \ud800 escapes)

    problems, skipped = load_problems(path)

    assert [p.answer for p in problems] == ["2", "7"] and problems[0].metadata == {"source": "gsm8k"}
    escape = "is not valid Unicode text (a lone surrogate \\u{} at character {}, a broken \\u escape)"
    assert skipped == [
        (2, f"column 'source' {escape.format('d800', 3)}"),
        (3, f"column 'extra'['tags'][1] {escape.format('dc80', 1)}"),
        (4, f"column 'extra' has a key that {escape.format('d83d', 1)}"),
        (5, f"a column name {escape.format('dfff', 1)}"),
    ]


def test_prompts_already_chat_templated_are_counted_skips(tmp_path: Path) -> None:
    """The pipeline applies the model's chat template to every prompt: a row whose prompt is already a rendered
    chat (`<|im_start|>user ...`, verl's or a Llama 3 export) was templated twice, and the model trained on a user
    turn holding another chat's markers as text. Such rows are counted skips naming the fix; a file of nothing
    else is the usual ConfigError."""
    rows = [
        {"prompt": "What is 1 + 1?", "answer": "2"},
        {"prompt": "<|im_start|>user\nWhat is 2 + 1?<|im_end|>\n<|im_start|>assistant\n", "answer": "3"},
        {"prompt": "  <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 3 + 1?", "answer": "4"},
        {"prompt": "What is <|im_start|> in ChatML?", "answer": "a marker"},  # (markers inside the text are text)
        {
            "prompt": [{"role": "system", "content": "[INST] Box it."}, {"role": "user", "content": "5+1?"}],
            "answer": "6",
        },
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    problems, skipped = load_problems(path)

    assert [p.answer for p in problems] == ["2", "a marker"]
    fix = "and would be templated again: give the raw user text, or chat messages as a list of {role, content}"
    assert skipped == [
        (2, f"'prompt' is already chat-templated (it opens with '<|im_start|>') {fix}"),
        (3, f"'prompt' is already chat-templated (it opens with '<|begin_of_text|>') {fix}"),
        (5, f"message 0 of 'prompt' is already chat-templated (it opens with '[INST]') {fix}"),
    ]
    path.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ConfigError, match=r"no usable rows \(1 skipped, first: line 1: 'prompt' is already chat-t"):
        FileTask(MathReward(), path=str(path))


# Nested past Python's recursion limit: valid JSON that json.loads cannot read.
DEEP = "[" * 100_000 + "]" * 100_000
TOO_DEEP = "invalid JSON (nested too deeply: past Python's recursion limit)"


@pytest.mark.parametrize("deep_line", [1, 3])
def test_a_jsonl_row_nested_too_deeply_is_a_counted_skip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, deep_line: int
) -> None:
    """A JSON line nested past the recursion limit ended the whole load in a bare RecursionError naming neither file
    nor line (as the first line, from the whole-file array check; later, from the line itself). split-nesting"""
    lines = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(4)]
    lines.insert(deep_line - 1, DEEP)
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")

    with caplog.at_level("WARNING"):
        problems, skipped = load_problems(path)

    assert [p.answer for p in problems] == ["1", "2", "3", "4"]
    assert skipped == [(deep_line, TOO_DEEP)]
    assert f"skipped 1 bad row(s): line {deep_line}: {TOO_DEEP}" in caplog.text
    # The code task reads its rows the same way.
    code = [json.dumps({"prompt": f"Echo {i}.", "tests": [{"input": "1", "output": "1"}]}) for i in range(2)]
    path.write_text("\n".join([*code, DEEP]) + "\n")
    assert load_code_problems(path)[1] == [(3, TOO_DEEP)]


def test_a_json_array_nested_too_deeply_is_an_error_naming_the_file(tmp_path: Path) -> None:
    """A `.json` array with a row nested past the recursion limit ended in a bare RecursionError naming no file: an
    array over several lines cannot be read row by row, so it is a ConfigError naming the file; a one-line array is
    read as its one line, a counted bad row (and a file of nothing else the usual "no usable rows"). split-nesting"""
    good = json.dumps({"prompt": "What is 1 + 1?", "answer": "2"})
    path = tmp_path / "rows.json"
    path.write_text(f"[\n{good},\n{DEEP}\n]\n")
    with pytest.raises(ConfigError, match=r"rows\.json: cannot read it as a JSON array \(nested too deeply"):
        load_problems(path)
    with pytest.raises(ConfigError, match=r"rows\.json: cannot read it as a JSON array \(nested too deeply"):
        FileTask(MathReward(), path=str(path))

    path.write_text(f"[{good}, {DEEP}]\n")
    with pytest.raises(ConfigError, match=rf"no usable rows \(1 skipped, first: line 1: {re.escape(TOO_DEEP)}"):
        load_problems(path)
