"""An integer column with a null in it is a float column in pandas (and in the Parquet, JSON lines and `datasets`
folders written from it): its 3 reached the rewards' and environments' row metadata as 3.0 (a `{metadata[level]}`
in a judge template read "3.0", a reward comparing it to an int index or a text "3" disagreed), while the answer
column had been read as "3" since an earlier fix. Such a column (every value whole or null, one null at least) reads
as ints and None now, in every data file kind; a float column stays float. Real files in tmp_path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from roll_envs.rewards.ifeval import InstructionReward
from roll_envs.tasks import load_problems
from roll_envs.tasks.instruct import InstructTask

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")


def _frame():
    return pd.DataFrame(
        {
            "prompt": ["q1?", "q2?", "q3?"],
            "answer": [3, None, 5],  # a null answer: the row is skipped as before
            "level": [3, None, 12],  # int with a null: float64 3.0, NaN, 12.0
            "retries": [0, 2, None],
            "ratio": [0.5, None, 2.0],  # a float column: stays float
            "weight": [1.0, 2.0, 3.0],  # whole floats but no null: a float column written as such, stays float
            "tag": ["a", None, "c"],
        }
    )


def _check(problems: list) -> None:
    assert [p.answer for p in problems] == ["3", "5"]
    first, last = problems[0].metadata, problems[1].metadata
    assert first["level"] == 3 and type(first["level"]) is int and last["level"] == 12 and type(last["level"]) is int
    assert first["retries"] == 0 and type(first["retries"]) is int and last["retries"] is None
    assert first["ratio"] == 0.5 and last["ratio"] == 2.0 and type(last["ratio"]) is float
    assert type(first["weight"]) is float and first["tag"] == "a"


def test_parquet_written_by_pandas(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    _frame().to_parquet(path)
    problems, skipped = load_problems(path)
    assert [n for n, _ in skipped] == [2]
    _check(problems)


def test_json_lines_written_by_pandas(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    _frame().to_json(path, orient="records", lines=True)
    assert '"level":3.0' in path.read_text()  # what pandas writes
    problems, _ = load_problems(path)
    _check(problems)


def test_a_json_column_with_a_non_whole_value_or_text_stays_as_written(tmp_path: Path) -> None:
    rows = [
        {"prompt": "q1?", "answer": "1", "n": 3.0, "mixed": 2.0, "x": 1.0, "nan": 4.0},
        {"prompt": "q2?", "answer": "2", "n": None, "mixed": "two", "x": 1.5, "nan": float("nan")},
        {"prompt": "q3?", "answer": "3", "n": 7, "mixed": None, "x": None},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems, _ = load_problems(path)
    meta = [p.metadata for p in problems]
    assert [m["n"] for m in meta] == [3, None, 7] and type(meta[0]["n"]) is int
    assert meta[0]["mixed"] == 2.0 and type(meta[0]["mixed"]) is float  # a text in the column: not integers
    assert type(meta[0]["x"]) is float  # 1.5 in the column: floats
    assert meta[0]["nan"] == 4 and type(meta[0]["nan"]) is int and meta[1]["nan"] is None  # NaN: a null


def test_a_datasets_folder_and_the_instruct_task(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_pandas(_frame()).save_to_disk(str(folder))
    problems, _ = load_problems(folder)
    _check(problems)
    # the instruct task reads its rows the same way (its other columns are the problem's metadata)
    frame = _frame().drop(columns=["answer"])
    frame["constraints"] = [json.dumps([{"type": "no_commas"}])] * 3
    path = tmp_path / "instruct.parquet"
    frame.to_parquet(path)
    task = InstructTask(InstructionReward(), path=str(path), eval_fraction=0.0)
    levels = sorted(p.metadata["level"] for p in task.train_set() if p.metadata["level"] is not None)
    assert levels == [3, 12] and all(type(v) is int for v in levels)
    assert not any(isinstance(p.metadata["level"], float) and math.isnan(p.metadata["level"]) for p in task.train_set())
