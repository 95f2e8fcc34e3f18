"""Data rows whose text is not what it seems: a `\\ud800` escape (valid JSON, no Unicode character). A `.jsonl` file
that holds one JSON array of rows: test_tasks.py, with its `.json` twin."""

from __future__ import annotations

import json
from pathlib import Path

from roll_envs.rewards.math import MathReward
from roll_envs.tasks import FileTask
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
