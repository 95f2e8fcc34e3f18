"""Data rows that load as something other than what they say: a JSON object naming a key twice with different
values (`json` keeps the last one, unsaid), and a Parquet decimal column's whole numbers ("3.00")."""

from __future__ import annotations

import decimal
import json
from pathlib import Path

import pytest

from roll_envs.rewards.math import MathReward
from roll_envs.tasks import FileTask, load_problems
from roll_envs.tasks.code import load_code_problems


def test_a_json_row_repeating_a_key_with_another_value_is_a_counted_skip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`{"answer": "1", "answer": "2"}` trained on the answer 2 and said nothing: which one the row's author meant
    is unknown (a generator pasting two dicts into one line), so the row is a counted, reported skip. A key
    repeated with the same value is harmless and the row is kept."""
    lines = [
        '{"prompt": "What is 1 + 1?", "answer": "2"}',
        '{"prompt": "What is 2 + 2?", "answer": "4", "answer": "5"}',
        '{"prompt": "What is 3 + 3?", "prompt": "What is 3 + 4?", "answer": "6"}',
        '{"prompt": [{"role": "user", "content": "What is 5 + 5?", "content": "What is 5 + 6?"}], "answer": "10"}',
        '{"prompt": "What is 6 + 6?", "answer": "12", "meta": {"id": 1, "id": 2}}',
        '{"prompt": "What is 7 + 7?", "answer": "14", "answer": "14"}',  # the same value twice: harmless
        '{"prompt": "What is 8 + 8?", "answer": 16, "answer": 16.0}',  # another type: not the same value
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")

    with caplog.at_level("WARNING"):
        problems, skipped = load_problems(path)

    assert [(p.prompt, p.answer) for p in problems] == [("What is 1 + 1?", "2"), ("What is 7 + 7?", "14")]
    assert [n for n, _ in skipped] == [2, 3, 4, 5, 7]
    assert "repeats the key 'answer' with different values" in skipped[0][1]
    assert "'prompt'" in skipped[1][1] and "'content'" in skipped[2][1] and "'id'" in skipped[3][1]
    assert "skipped 5 bad row(s)" in caplog.text

    # The same rows as one JSON array (numbered from 1 like lines), and read by the code task's loader too.
    array = tmp_path / "rows.json"
    array.write_text("[\n" + ",\n".join(lines) + "\n]\n")
    problems, skipped = load_problems(array)
    assert [p.prompt for p in problems] == ["What is 1 + 1?", "What is 7 + 7?"]
    assert [n for n, _ in skipped] == [2, 3, 4, 5, 7]
    task = FileTask(MathReward(), path=str(array), eval_fraction=0.0)
    assert [n for _, n, _ in task.skipped] == [2, 3, 4, 5, 7]

    code = tmp_path / "code.jsonl"
    tests = '[{"input": "", "output": "1"}]'
    code.write_text(
        f'{{"prompt": "Print 1.", "tests": {tests}}}\n{{"prompt": "Print 2.", "tests": {tests}, "tests": []}}\n'
    )
    code_problems, code_skipped = load_code_problems(code)
    assert [p.prompt for p in code_problems] == ["Print 1."]
    assert [n for n, _ in code_skipped] == [2] and "repeats the key 'tests'" in code_skipped[0][1]


def test_a_parquet_decimal_answer_that_is_whole_reads_as_an_integer(tmp_path: Path) -> None:
    """A decimal column (SQL NUMERIC(5, 2) exports) gave the answer 3 as "3.00" and 1.5 as "1.50", where the same
    numbers in a float column read "3" and "1.5" (the module's rule: a whole number answer is an integer), so a
    reward comparing text failed the model's correct 3."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    values = ["3.00", "1.50", "-0.00", "100", "0.000001", "-2.25", "12345678901234567890123456789012.000000"]
    table = pa.table(
        {
            "prompt": [f"q{i}" for i in range(len(values))],
            "answer": pa.array([decimal.Decimal(v) for v in values], pa.decimal128(38, 6)),
        }
    )
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)

    problems, skipped = load_problems(path)

    assert skipped == []
    big = "12345678901234567890123456789012"  # all 32 digits: not rounded to 28, decimal's default precision
    assert [p.answer for p in problems] == ["3", "1.5", "0", "100", "0.000001", "-2.25", big]
    floats = tmp_path / "floats.jsonl"  # the same numbers as JSON floats read alike (a float holds 17 digits)
    small = values[:-1]
    floats.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": float(v)}) + "\n" for i, v in enumerate(small)))
    assert [p.answer for p in load_problems(floats)[0]] == [p.answer for p in problems[:-1]]
