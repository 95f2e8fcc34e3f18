"""float32 (and float16) values inside nested Parquet / datasets columns read as the decimals written: a struct
answer (`answer_key=reward_model.ground_truth`, verl's row layout) of float32 0.1 was the answer
"0.10000000149011612" that no correct response matched, and float32 lists, lists of structs and maps in the other
columns reached the rewards' metadata with the same noise (only flat float32 columns were read as written). Real
files in tmp_path, a real reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_envs.rewards.math import MathReward
from roll_envs.tasks import load_problems

VALUES = [0.1, 2.3, 1e-7]
ANSWERS = ["0.1", "2.3", "0.0000001"]


def _rows(pa) -> dict:  # (pa: pyarrow, imported by the test)
    f32, f16 = pa.float32(), pa.float16()
    gt = pa.struct([("ground_truth", f32), ("style", pa.string())])
    return {
        "prompt": [f"q{i}?" for i in range(3)],
        "reward_model": pa.array([{"ground_truth": v, "style": "rule"} for v in VALUES], type=gt),
        "tolerances": pa.array([[0.1, 0.3], [], None], type=pa.list_(f32)),
        "cases": pa.array([[{"x": 0.7, "w": 0.1}]] * 3, type=pa.large_list(pa.struct([("x", f32), ("w", f16)]))),
        "scales": pa.array([[("a", 0.2)]] * 3, type=pa.map_(pa.string(), f32)),
        "exact": pa.array([[0.1 + 0.2]] * 3, type=pa.list_(pa.float64())),  # float64 reads as it always did
    }


def _check(problems: list, maps: bool) -> None:
    assert [p.answer for p in problems] == ANSWERS
    meta = problems[0].metadata
    assert meta["reward_model"] == {"ground_truth": 0.1, "style": "rule"}
    assert meta["tolerances"] == [0.1, 0.3] and problems[1].metadata["tolerances"] == []
    assert problems[2].metadata["tolerances"] is None
    assert meta["cases"] == [{"x": 0.7, "w": 0.1}]
    if maps:
        assert meta["scales"] == [("a", 0.2)]
    assert meta["exact"] == [0.30000000000000004]
    res = MathReward().score([f"\\boxed{{{v}}}" for v in VALUES], [p.answer for p in problems])
    assert res.correct == [1.0] * 3


def test_nested_float32_values_in_parquet_read_as_written(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "nested.parquet"
    pq.write_table(pa.table(_rows(pa)), path)
    problems, skipped = load_problems(path, answer_key="reward_model.ground_truth")
    assert skipped == []
    _check(problems, maps=True)


def test_nested_float32_values_in_a_datasets_folder_read_as_written(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    rows = _rows(pa)
    del rows["scales"]  # (datasets has no map feature)
    folder = tmp_path / "ds"
    datasets.Dataset(pa.table(rows)).save_to_disk(str(folder))
    problems, skipped = load_problems(folder, answer_key="reward_model.ground_truth")
    assert skipped == []
    _check(problems, maps=False)
