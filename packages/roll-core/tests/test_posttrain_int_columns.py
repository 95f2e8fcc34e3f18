"""Post-training rows (roll_core.posttrain.rows) with an integer column holding a null: pandas makes such a column
float64 (3 -> 3.0, a null NaN) and the Parquet, `datasets` folders and JSON lines written from the frame hold
floats. Read as they were written, a `prompt_id` of 3.0 was no group id (text or an integer: every rollout row a
`wrong_type` skip) and an id put in text read "3.0". They read as ints and None now (roll_core.int_columns, as the
RL tasks read them), top-level and in struct fields. Real files in tmp_path."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.rows import Skips, read_rows
from roll_core.posttrain.source import load_rows
from roll_core.testing.chat_templates import family_tokenizer

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")


def _frame() -> Any:
    """Four rollout rows as pandas holds them: `prompt_id` an int column with a null (3.0, 3.0, NaN, 7.0), `reward`
    a float column (stays float), `sample` whole floats without a null (stays float), `meta` a struct whose `id` is
    an int with a null and `deep.level` one two structs down; `prompt_ids` a list (left as it is)."""
    frame = pd.DataFrame(
        {
            "prompt_id": [3, 3, None, 7],
            "prompt_ids": [[5, 6], [5, 6], [5, 8], [5, 9]],
            "response_ids": [[10], [11], [12], [13]],
            "reward": [1.0, 0.0, 0.5, 1.0],
            "correct": [True, False, True, True],
            "sample": [0.0, 1.0, 0.0, 0.0],
        }
    )
    assert str(frame["prompt_id"].dtype) == "float64"  # what pandas makes of an int column with a null
    ids = pd.DataFrame({"id": [1, None, 2, 4]}).to_dict("records")
    levels = pd.DataFrame({"level": [None, 2, 7, 8]}).to_dict("records")
    frame["meta"] = [{**m, "deep": lv} for m, lv in zip(ids, levels, strict=True)]
    return frame


def _write(tmp_path: Path, kind: str) -> str:
    frame = _frame()
    if kind == "parquet":
        path = tmp_path / "rows.parquet"
        table = pa.Table.from_pandas(frame, preserve_index=False)
        assert str(table.schema.field("meta").type.field("id").type) == "double"
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    elif kind == "datasets":
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "ds"
        datasets.Dataset.from_pandas(frame, preserve_index=False).save_to_disk(str(path))
    else:
        path = tmp_path / "rows.jsonl"
        path.write_text(frame.to_json(orient="records", lines=True))  # 3.0 and null, as pandas writes them
    return str(path)


@pytest.mark.parametrize("kind", ["parquet", "datasets", "jsonl"])
def test_an_int_column_with_a_null_reads_as_ints(tmp_path: Path, kind: str) -> None:
    rows = [r.row for r in read_rows([_write(tmp_path, kind)], "data.path", Skips())]
    assert [r["prompt_id"] for r in rows] == [3, 3, None, 7]
    assert all(type(r["prompt_id"]) is int for r in (rows[0], rows[1], rows[3]))
    assert f"id {rows[0]['prompt_id']}" == "id 3"  # in text: "3", not "3.0"
    meta = [r["meta"] for r in rows]
    assert [m["id"] for m in meta] == [1, None, 2, 4] and type(meta[0]["id"]) is int
    assert [m["deep"]["level"] for m in meta] == [None, 2, 7, 8] and type(meta[1]["deep"]["level"]) is int
    assert [r["reward"] for r in rows] == [1.0, 0.0, 0.5, 1.0] and type(rows[0]["reward"]) is float  # 0.5: floats
    assert [type(r["sample"]) for r in rows] == [float] * 4  # whole floats without a null: as written
    assert rows[0]["prompt_ids"] == [5, 6] and rows[0]["correct"] is True


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_rollout_rows_with_a_numeric_prompt_id_with_a_null_make_pairs(tmp_path: Path, kind: str) -> None:
    """Preference pairs group a prompt's rollout rows by `prompt_id` (text or an integer): 3.0 made every row with
    an id a `wrong_type` skip. Prompt 3's two samples make one pair now; the row without an id groups by its prompt
    ids (alone: no pair), as does prompt 7's one sample."""
    data = DataConfig(path=_write(tmp_path, kind), pairs_per_prompt=4)
    src = load_rows("preference", data, family_tokenizer("tiny"), max_prompt_length=64, max_response_length=64)
    pairs = [(p.chosen.response_ids, p.rejected.response_ids) for p in src.train.items]
    assert pairs == [([10], [11])] and "wrong_type" not in src.train.skipped


def test_a_float_column_of_whole_values_and_nan_in_json_is_an_int_column(tmp_path: Path) -> None:
    """JSON's NaN (what `json.dumps` writes of pandas' records) is a null too; a non-whole value keeps floats."""
    path = tmp_path / "rows.jsonl"
    rows = [{"n": 3.0, "x": 0.5}, {"n": math.nan, "x": math.nan}, {"n": 4.0, "x": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = [r.row for r in read_rows([str(path)], "data.path", Skips())]
    assert [g["n"] for g in got] == [3, None, 4] and type(got[0]["n"]) is int
    assert got[2]["x"] == 1.0 and type(got[2]["x"]) is float and math.isnan(got[1]["x"])
