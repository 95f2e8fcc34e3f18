"""Data files as tasks, the held-out side: env=multi keeps a problem one sub-task holds out out of every other
sub-task's training; a training row that is a held-out row's problem but for whitespace in its prompt is left out
of training (counted, logged); and Parquet/datasets float32 answer columns read as the decimals written, not as
the binary float32 value's noise (0.1 read as "0.10000000149011612", which no correct answer matched). Real files
in tmp_path, real tasks and rewards."""

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
    """A benchmark as one domain's env.eval_path, also inside another domain's training file (some rows but for
    whitespace): it was trained on and evaluated (each file task kept only its own splits apart)."""
    bench = [{"prompt": f"benchmark {i}?", "answer": str(i)} for i in range(5)]
    math_path = _write(tmp_path / "math.jsonl", [{"prompt": f"math {i}?", "answer": str(i)} for i in range(20)])
    bench_path = _write(tmp_path / "bench.jsonl", bench)
    # The benchmark inside the other file: three rows as they are, two but for whitespace (one problem to a model).
    copies = bench[:3] + [{**r, "prompt": r["prompt"].replace(" ", "  ") + "\n"} for r in bench[3:]]
    mix_path = _write(tmp_path / "mix.jsonl", [{"prompt": f"mix {i}?", "answer": str(i)} for i in range(20)] + copies)
    tasks = {
        "math": FileTask(MathReward(), path=str(math_path), eval_path=str(bench_path)),
        "mix": FileTask(MathReward(), path=str(mix_path), eval_fraction=0.0),
    }
    with caplog.at_level(logging.WARNING, logger="roll_envs.tasks.multi"):
        task = MultiTask(tasks)
    train = {" ".join(p.prompt.split()) for p in task.train_set()}
    held = {p.prompt for p in task.eval_set()}
    assert held == {r["prompt"] for r in bench}
    assert not train & held
    assert len(task.train_set()) == 40 and task.domain_slices() == {"math": range(0, 20), "mix": range(20, 40)}
    assert "5 of the 25 training problems of env.tasks.mix are held out by another sub-task" in caplog.text
    assert task.also_held_out == 5  # what the run's data/also_held_out and summary report
    # A sub-task's own twins of its held-out rows count too: two of math's rows are benchmark rows but for spaces.
    twins = [{**r, "prompt": r["prompt"] + "\n"} for r in bench[:2]]
    math_rows = [{"prompt": f"math {i}?", "answer": str(i)} for i in range(20)]
    math_twins = _write(tmp_path / "math2.jsonl", math_rows + twins)
    both = {"math": FileTask(MathReward(), path=str(math_twins), eval_path=str(bench_path)), "mix": tasks["mix"]}
    assert both["math"].also_held_out == 2 and MultiTask(both).also_held_out == 2 + 5
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
    answers = ["0.1", "2.3", "3", "0.0000001", "123456.7"]
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


def test_a_prompt_repeated_but_for_whitespace_is_not_both_trained_and_held_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hash split hashes the raw prompt, so "Q?" and "Q?\\n" (or a doubled space) fell on different sides: with
    300 problems each written twice that way, 53 of the 54 held-out problems were trained on too. The split itself
    is unchanged (a resumed run keeps its sides); the training copies of held-out problems are left out, counted
    and logged once. The same holds for rows of env.eval_path."""
    from types import SimpleNamespace

    from roll_envs.tasks.base import held_out_split, split_key, stable_fraction

    rows = []
    for i in range(300):
        prompt = f"What is {i} + {i}? Box it."
        rows += [{"prompt": prompt, "answer": str(2 * i)}, {"prompt": prompt + "\n", "answer": str(2 * i)}]
        rows.append({"prompt": prompt.replace(" + ", "  +  "), "answer": str(2 * i)})
    data = _write(tmp_path / "rows.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="roll_envs.tasks.base"):
        task = FileTask(MathReward(), path=str(data), eval_size=1000)

    def loose(p: object) -> str:
        return " ".join(p.prompt.split())

    held = {loose(p) for p in task.eval_set()}
    assert len(held) > 20 and not held & {loose(p) for p in task.train_set()}
    # The sides are still decided by the raw prompt's hash: every held-out row is still held out, nothing moved in.
    assert all(stable_fraction(split_key(p)) < 0.1 for p in task.eval_set())
    raw_train = [p for p in task.train_set() if stable_fraction(split_key(p)) >= 0.1]
    assert len(raw_train) == len(task.train_set())
    dropped = 900 - len(task.eval_set()) - len(task.train_set())
    assert dropped > 0 and task.also_held_out == dropped
    assert caplog.text.count("repeat a held-out row's prompt but for whitespace") == 1
    assert f"{dropped} of its 900 rows repeat a held-out row's prompt" in caplog.text
    # Exact repeats share a side already: nothing is left out, nothing said.
    caplog.clear()
    exact = _write(tmp_path / "exact.jsonl", [r for r in rows if not r["prompt"].endswith("\n")][::2] * 2)
    with caplog.at_level(logging.WARNING, logger="roll_envs.tasks.base"):
        plain = FileTask(MathReward(), path=str(exact), eval_size=1000)
    assert plain.also_held_out == 0 and "but for whitespace" not in caplog.text
    # env.eval_path holding a problem with other whitespace: its training copy is left out too.
    bench = _write(tmp_path / "bench.jsonl", [{"prompt": r["prompt"] + " \n", "answer": r["answer"]} for r in rows[:9]])
    with_bench = FileTask(MathReward(), path=str(data), eval_path=str(bench))
    assert with_bench.also_held_out == 9 and len(with_bench.train_set()) == 891
    # Pictures are part of the problem: the same question about another picture is another problem.
    pics = [SimpleNamespace(prompt=f"Q{i}  about <image>", images=[f"{i}".encode()]) for i in range(200)]
    near = [SimpleNamespace(prompt=f"Q{i} about <image>\n", images=[f"{i}".encode()]) for i in range(200)]
    other = [SimpleNamespace(prompt=f"Q{i} about <image>\n", images=[b"other"]) for i in range(200)]
    counts: dict[str, int] = {}
    train, held_pics = held_out_split(
        pics + near + other, None, eval_fraction=0.2, eval_size=600, path="p", counts=counts
    )
    held_keys = {(loose(p), bytes(p.images[0])) for p in held_pics}
    assert not held_keys & {(loose(p), bytes(p.images[0])) for p in train}
    assert all(p in train for p in other if stable_fraction(split_key(p)) >= 0.2)
    assert counts["also_held_out"] == 600 - len(train) - len(held_pics) > 0
