"""Data files as tasks, the held-out side: env=multi keeps a problem one sub-task holds out out of every other
sub-task's training; and Parquet/datasets float32 answer columns read as the decimals written, not as the binary
float32 value's noise (0.1 read as "0.10000000149011612", which no correct answer matched). Real files in
tmp_path, real tasks and rewards."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from roll_core.errors import ConfigError
from roll_envs.rewards.math import MathReward
from roll_envs.tasks import FileTask, load_problems
from roll_envs.tasks.multi import MultiTask


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_problem_another_sub_task_holds_out_is_not_trained_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A benchmark as one domain's env.eval_path, also inside another domain's training file: it was trained on
    and evaluated (each file task kept only its own splits apart)."""
    bench = [{"prompt": f"benchmark {i}?", "answer": str(i)} for i in range(5)]
    math_path = _write(tmp_path / "math.jsonl", [{"prompt": f"math {i}?", "answer": str(i)} for i in range(20)])
    bench_path = _write(tmp_path / "bench.jsonl", bench)
    mix_path = _write(tmp_path / "mix.jsonl", [{"prompt": f"mix {i}?", "answer": str(i)} for i in range(20)] + bench)
    tasks = {
        "math": FileTask(MathReward(), path=str(math_path), eval_path=str(bench_path)),
        "mix": FileTask(MathReward(), path=str(mix_path), eval_fraction=0.0),
    }
    with caplog.at_level(logging.WARNING, logger="roll_envs.tasks.multi"):
        task = MultiTask(tasks)
    train = {p.prompt for p in task.train_set()}
    held = {p.prompt for p in task.eval_set()}
    assert held == {r["prompt"] for r in bench}
    assert not train & held
    assert len(task.train_set()) == 40 and task.domain_slices() == {"math": range(0, 20), "mix": range(20, 40)}
    assert "5 of the 25 training problems of env.tasks.mix are held out by another sub-task" in caplog.text
    # A sub-task evaluating on its own training rows (env.eval_path = env.path) keeps them: that is on purpose.
    same = MultiTask({"math": FileTask(MathReward(), path=str(bench_path), eval_path=str(bench_path))})
    assert len(same.train_set()) == 5 and len(same.eval_set()) == 5
    # Nothing left to train on is an error naming the sub-task, not an empty domain.
    with pytest.raises(ConfigError, match=r"env.tasks.mix: every training problem is held out by another sub-task"):
        MultiTask(
            {
                "math": FileTask(MathReward(), path=str(math_path), eval_path=str(bench_path)),
                "mix": FileTask(MathReward(), path=str(bench_path), eval_fraction=0.0),
            }
        )


def test_float32_answer_columns_read_as_the_decimals_written(tmp_path: Path) -> None:
    """Parquet written from a float32 column (pandas .astype("float32"), a datasets Value("float32") feature): 0.1
    was the answer "0.10000000149011612", so the correct \\boxed{0.1} scored 0 on every such row."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    values = [0.1, 2.3, 3.0, 1e-7, 123456.7, None]
    answers = ["0.1", "2.3", "3.0", "0.0000001", "123456.7"]
    path = tmp_path / "f32.parquet"
    table = pa.table(
        {
            "prompt": [f"q{i}?" for i in range(6)],
            "answer": pa.array(values, type=pa.float32()),
            "weight": pa.array([0.1] * 6, type=pa.float16()),
            "exact": pa.array([0.1 + 0.2] * 6, type=pa.float64()),  # a float64 column reads as it always did
        }
    )
    pq.write_table(table, path)
    problems, skipped = load_problems(path)
    assert [p.answer for p in problems] == answers
    assert skipped == [(6, "missing or empty 'answer'")]
    assert problems[0].metadata == {"weight": 0.1, "exact": 0.30000000000000004}
    res = MathReward().score([f"\\boxed{{{v}}}" for v in (0.1, 2.3, 3, 1e-7, 123456.7)], [p.answer for p in problems])
    assert res.correct == [1.0] * 5
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    features = datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("float32")})
    rows = {"prompt": [f"q{i}?" for i in range(5)], "answer": values[:5]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(folder))
    assert [p.answer for p in load_problems(folder)[0]] == answers
