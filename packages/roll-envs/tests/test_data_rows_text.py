"""Data rows whose text is not what it seems: a `\\ud800` escape (valid JSON, no Unicode character). A `.jsonl` file
that holds one JSON array of rows: test_tasks.py, with its `.json` twin."""

from __future__ import annotations

import json
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
