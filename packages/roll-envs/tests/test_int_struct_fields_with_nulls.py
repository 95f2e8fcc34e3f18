"""An integer field with a null inside a struct column (`{"meta": {"id": 3}}`, the dicts pandas builds from a frame
whose `id` column has a null: `{"id": 3.0}`, `{"id": nan}`) read as 3.0 and NaN in the rows' metadata, in every
data file kind, where a top-level column like it reads as ints and None since an earlier fix. A struct's field is a
column of its own now, by the same rule (roll_envs.tasks._int_columns). Real files in tmp_path."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from roll_envs.tasks import load_problems
from roll_envs.tasks._int_columns import restore_int_columns

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")


def _records() -> list[dict[str, Any]]:
    """Three rows whose struct `meta` comes from pandas records: `id` int with a null (3.0, NaN, 5.0), `ratio` a
    float (stays float), `weight` whole floats without a null (stays float), `deep.level` an int with a null two
    structs down; `scores` a list of floats with a null (left as it is)."""
    frame = pd.DataFrame({"id": [3, None, 5], "ratio": [0.5, None, 2.0], "weight": [1.0, 2.0, 3.0]})
    levels = pd.DataFrame({"level": [None, 2, 7]}).to_dict("records")
    rows = []
    for i, meta in enumerate(frame.to_dict("records")):
        rows.append(
            {
                "prompt": f"q{i}?",
                "answer": str(i),
                "meta": {**meta, "deep": levels[i]},
                "scores": [1.0, None] if i == 0 else [2.0],
            }
        )
    return rows


def _check(problems: list) -> None:
    meta = [p.metadata["meta"] for p in problems]
    assert [m["id"] for m in meta] == [3, None, 5] and all(type(m["id"]) is int for m in (meta[0], meta[2]))
    assert [m["deep"]["level"] for m in meta] == [None, 2, 7] and type(meta[1]["deep"]["level"]) is int
    assert meta[0]["ratio"] == 0.5 and type(meta[2]["ratio"]) is float  # 0.5 in it: a float column
    assert [type(m["weight"]) for m in meta] == [float] * 3  # whole floats without a null: as written
    assert type(problems[1].metadata["scores"][0]) is float  # in a list: left as it is


def test_a_parquet_struct_field(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    table = pa.Table.from_pylist(_records())
    assert str(table.schema.field("meta").type.field("id").type) == "double"  # what pandas' records make of it
    pq.write_table(table, path)
    problems, _ = load_problems(path)
    _check(problems)


def test_a_json_lines_struct_field(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))  # NaN as JSON's NaN
    problems, _ = load_problems(path)
    _check(problems)


def test_a_datasets_folder_struct_field(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(_records()).save_to_disk(str(folder))
    problems, _ = load_problems(folder)
    _check(problems)


def test_a_path_that_is_an_object_in_one_row_and_a_number_in_another_is_no_column() -> None:
    rows: list[tuple[int, Any]] = [
        (1, {"m": {"a": 1.0}, "n": {"b": 2.0}}),
        (2, {"m": 3.0, "n": {"b": None}}),
        (3, {"m": None, "n": {"b": float("nan")}}),
    ]
    restore_int_columns(rows)
    assert rows[0][1]["m"] == {"a": 1.0} and type(rows[1][1]["m"]) is float  # `m` is no column, nor `m.a`
    assert rows[0][1]["n"]["b"] == 2 and type(rows[0][1]["n"]["b"]) is int and rows[2][1]["n"]["b"] is None
    # Arrow rows: only the floating columns named (a path) are read
    arrow: list[tuple[int, Any]] = [(1, {"s": {"x": 1.0, "y": 1.0}}), (2, {"s": {"x": None, "y": math.nan}})]
    restore_int_columns(arrow, [("s", "y")])
    assert type(arrow[0][1]["s"]["x"]) is float and type(arrow[0][1]["s"]["y"]) is int and arrow[1][1]["s"]["y"] is None
