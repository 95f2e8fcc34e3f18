"""Built-in tasks and the file loader: determinism, disjoint splits, bad-row reporting."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from roll_core.errors import ConfigError
from roll_envs.rewards.math import MathReward
from roll_envs.tasks import ArithmeticTask, CountdownReward, CountdownTask, FileTask, load_problems


def test_arithmetic_is_seeded_and_disjoint() -> None:
    a = ArithmeticTask(MathReward(), digits=2, train_size=300, eval_size=50, seed=3)
    b = ArithmeticTask(MathReward(), digits=2, train_size=300, eval_size=50, seed=3)
    c = ArithmeticTask(MathReward(), digits=2, train_size=300, eval_size=50, seed=4)
    assert a.train_set() == b.train_set() and a.eval_set() == b.eval_set()
    assert a.train_set() != c.train_set()
    train_ids = {p.id for p in a.train_set()} | {p.id for p in c.train_set()}
    assert not train_ids & ({p.id for p in a.eval_set()} | {p.id for p in c.eval_set()})
    p = a.eval_set()[0]
    x, y = p.prompt.split("What is ")[1].split("?")[0].split(" + ")
    assert int(p.answer) == int(x) + int(y) and 10 <= int(x) <= 99
    assert "\\boxed{}" in p.prompt


def test_arithmetic_answers_score_correct() -> None:
    task = ArithmeticTask(MathReward(), digits=1, num_terms=3, ops=["+", "-", "*"], train_size=50, eval_size=10)
    probs = task.train_set()[:20]
    res = task.score([f"\\boxed{{{p.answer}}}" for p in probs], probs)
    assert res.correct == [1.0] * 20


def test_arithmetic_worked_examples_come_from_training_split() -> None:
    task = ArithmeticTask(MathReward(), digits=2, train_size=50, eval_size=50, examples=2)
    msgs = task.messages(task.eval_set()[0])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    expr, answer = msgs[1]["content"].split(" = ")[0], msgs[1]["content"].split("boxed{")[1].rstrip("}.")
    assert eval(expr) == int(answer) and msgs[0]["content"] == f"What is {expr}? {task.instruction}"
    assert f"What is {expr}?" not in {p.prompt.split(" Put")[0] for p in task.eval_set()}
    assert MathReward().score([msgs[1]["content"]], [answer]).correct == [1.0]


@pytest.mark.parametrize("ops", [["+"], ["*"]])
def test_arithmetic_repeats_problems_of_a_small_held_out_split_instead_of_failing(ops: list[str]) -> None:
    """One-digit sums with 10 % held out: the hash split holds 6 distinct sums where the estimate said 9, and drawing
    100 held-out problems failed ('cannot draw'); they repeat, as the docstring says, never leaving the split."""
    task = ArithmeticTask(MathReward(), digits=1, ops=ops, eval_fraction=0.1, train_size=50, eval_size=100)
    held = {p.id for p in task.eval_set()}
    assert len(task.eval_set()) == 100 and 1 < len(held) <= 10
    assert not held & {p.id for p in task.train_set()}


def test_arithmetic_bad_config() -> None:
    with pytest.raises(ValueError, match="unsupported ops"):
        ArithmeticTask(MathReward(), ops=["^"])


def test_countdown_targets_are_reachable() -> None:
    task = CountdownTask(CountdownReward(), train_size=30, eval_size=10)
    assert len(task.train_set()) == 30 and not {p.id for p in task.train_set()} & {p.id for p in task.eval_set()}
    for p in task.train_set():
        target, nums = p.answer.split("|")
        assert int(target) > 0 and len(nums.split(",")) == 3


def test_countdown_empty_box_copied_from_the_prompt_is_no_answer() -> None:
    """As the math reward: `\\boxed{}` earns no format bonus and counts as no_boxed, not as a malformed equation."""
    res = CountdownReward(format_weight=0.1).score([r"I will put the final equation in \boxed{}."], ["7|3,4"])
    assert res.scores == [0.0] and res.formatted == [0.0]
    assert res.counters == {"errors": 0, "no_boxed": 1, "wrong_numbers": 0}
    assert CountdownReward(format_weight=0.1).score([r"\boxed{3+4}"], ["7|3,4"]).scores == [pytest.approx(1.1)]


@pytest.mark.parametrize(
    ("equation", "answer", "correct"),
    [
        (r"\left(3 + 5\right) \times 2", "16|3,5,2", 1.0),
        (r"\Big[ 3+5 \Big]\!\cdot 2 = 16", "16|3,5,2", 1.0),
        (r"\left\{3 + 5\right\} \times 2", "16|3,5,2", 1.0),
        (r"\frac{\left(3 + 5\right) \times 4}{2}", "16|3,5,4,2", 1.0),
        (r"\left(3 - 5\right) \times 2", "16|3,5,2", 0.0),  # wrong value: still wrong once the LaTeX is read
        (r"\left|3 - 5\right| \times 8", "16|3,5,8", 0.0),  # |x| is not + - * /: refused
    ],
)
def test_countdown_reads_latex_delimiters_of_a_correct_equation(equation: str, answer: str, correct: float) -> None:
    # A right equation written with \left( ... \right) (as models often write LaTeX) was "not an expression": 0.
    result = CountdownReward().score([f"\\boxed{{{equation}}}"], [answer])
    assert result.correct == [correct]
    assert result.counters["errors"] == (1 if "|" in equation else 0)


@pytest.mark.parametrize(
    "kwargs", [{"eval_fraction": 0.0}, {"max_number": 1}, {"eval_fraction": 1.0}], ids=["no-held-out", "one-key", "all"]
)
def test_countdown_settings_that_leave_a_split_empty_are_an_error_not_a_hang(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="countdown: cannot draw"):
        CountdownTask(CountdownReward(), train_size=10, eval_size=5, **kwargs)


def test_rows_also_in_eval_path_do_not_train(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The training and held-out sets never share a problem: training rows that env.eval_path also holds are left
    out of training, with a warning."""
    rows = [{"prompt": f"Q{i}: what is {i} + 1?", "answer": str(i + 1)} for i in range(50)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
    with caplog.at_level(logging.WARNING):
        task = FileTask(MathReward(), path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "test.jsonl"))
    train, held = {p.prompt for p in task.train_set()}, {p.prompt for p in task.eval_set()}
    assert len(train) == 40 and len(held) == 10 and not train & held
    assert "10 of its 50 rows are also in env.eval_path" in caplog.text


def test_file_task_reports_bad_rows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) for i in range(40)]
    lines[3] = "{not json"
    lines[7] = json.dumps({"prompt": "no answer"})
    lines[9] = json.dumps(["a", "list"])
    lines[11] = json.dumps({"prompt": "", "answer": "1"})
    lines[12] = json.dumps({"prompt": "numeric answer ok", "answer": 5})
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        task = FileTask(MathReward(), path=str(path), eval_fraction=0.25)
    assert [(n, why.split(" (")[0]) for _, n, why in task.skipped] == [
        (4, "invalid JSON"),
        (8, "missing or empty 'answer'"),
        (10, "row is list, not an object"),
        (12, "missing or empty 'prompt'"),
    ]
    assert "skipped 4 bad row(s)" in caplog.text and "line 4" in caplog.text
    assert task.skipped_rows == {str(path): 4}  # what the loop puts in the metrics and the run summary
    assert ArithmeticTask(MathReward(), train_size=10, eval_size=5).skipped_rows == {}
    assert len(task.train_set()) + len(task.eval_set()) == 36
    assert not {p.id for p in task.train_set()} & {p.id for p in task.eval_set()}


def test_data_files_that_cannot_be_used_are_config_errors_naming_the_setting(tmp_path: Path) -> None:
    """roll-train turns a ConfigError into one message and exit status 2 (a traceback and exit 1 before)."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"q": 1}\n')
    with pytest.raises(ConfigError, match="no usable rows"):
        load_problems(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"does not exist: check env\.path"):
        FileTask(MathReward(), path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "rows.csv").write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match=r"unsupported data file .*rows\.csv"):
        load_problems(tmp_path / "rows.csv")
    (tmp_path / "garbled.parquet").write_bytes(b"PAR1 not really")
    pytest.importorskip("pyarrow")
    with pytest.raises(ConfigError, match=r"garbled\.parquet: cannot read it as Parquet .*env\.path"):
        load_problems(tmp_path / "garbled.parquet")
    (tmp_path / "folder").mkdir()
    pytest.importorskip("datasets")
    with pytest.raises(ConfigError, match=r"folder: cannot read it as a datasets folder .*env\.path"):
        load_problems(tmp_path / "folder")


@pytest.mark.parametrize("suffix", ["json", "jsonl"])
@pytest.mark.parametrize("layout", ["one object a line", "indented", "one line"])
def test_a_json_file_holding_an_array_of_rows_loads_every_row(tmp_path: Path, layout: str, suffix: str) -> None:
    """Read as JSON lines, an array written one object per line kept only its last row (the others end with a
    comma) and the run trained on that one prompt; an indented array had no usable row at all. The same for a
    `.jsonl` file that is one JSON array (an export saved under the wrong extension: on one line it was one bad
    "list" row)."""
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(20)]
    rows[4] = {"prompt": "", "answer": "1"}
    text = {
        "one object a line": "[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n",
        "indented": json.dumps(rows, indent=2),
        "one line": json.dumps(rows),
    }[layout]
    (tmp_path / f"rows.{suffix}").write_text(text)
    problems, skipped = load_problems(tmp_path / f"rows.{suffix}")
    assert [p.prompt for p in problems] == [r["prompt"] for r in rows if r["prompt"]]
    assert skipped == [(5, "missing or empty 'prompt'")]  # numbered by element, from 1
    # A JSON-lines file whose first row is an array is still read line by line, that row reported.
    (tmp_path / f"lines.{suffix}").write_text('["a list"]\n' + "".join(json.dumps(r) + "\n" for r in rows[:3]))
    problems, skipped = load_problems(tmp_path / f"lines.{suffix}")
    assert len(problems) == 3 and skipped == [(1, "row is list, not an object")]


def test_parquet_and_datasets_folder(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"What is {i}+2?", "solution": str(i + 2)} for i in range(30)]
    rows[5] = {"question": None, "solution": "7"}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    problems, skipped = load_problems(tmp_path / "d.parquet", prompt_key="question", answer_key="solution")
    assert len(problems) == 29 and skipped == [(6, "missing or empty 'question'")]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    problems2, skipped2 = load_problems(tmp_path / "ds", prompt_key="question", answer_key="solution")
    assert [p.prompt for p in problems2] == [p.prompt for p in problems] and skipped2 == skipped


def test_numeric_answers_are_plain_decimals_a_grader_matches(tmp_path: Path) -> None:
    """JSON numbers become answers as written in plain decimal: str(0.00001) is '1e-05', which neither the plain-
    number path nor math-verify matches against a model's \\boxed{0.00001}."""
    path = tmp_path / "numbers.jsonl"
    values = [0.00001, 1e16, 2.5, 3.0, 7, -1e-7]
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": v}) + "\n" for i, v in enumerate(values)))
    problems, skipped = load_problems(path)
    assert not skipped
    assert [p.answer for p in problems] == ["0.00001", "10000000000000000", "2.5", "3", "7", "-0.0000001"]
    boxed = [r"\boxed{0.00001}", r"\boxed{10000000000000000}", r"\boxed{2.5}", r"\boxed{3}", r"\boxed{7}"]
    assert MathReward().score(boxed, [p.answer for p in problems[:5]]).correct == [1.0] * 5


def test_an_integer_answer_column_with_nulls_reads_as_integers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An integer column with a null in it is float64 in pandas and Arrow, so Parquet, a `datasets` folder and
    pandas' JSON hold 3.0 for the answer 3: it was the answer "3.0", which a reward comparing text held against the
    model's 3. A whole float is its integer now, a fraction stays, and the null rows are counted, logged skips."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    values = [3.0, None, 2.5, -4.0, 1e16, 0.0, float("nan")]
    answers = ["3", "2.5", "-4", "10000000000000000", "0"]
    missing = [(2, "missing or empty 'answer'")]
    table = pa.table({"prompt": [f"q{i}?" for i in range(6)], "answer": pa.array(values[:6], type=pa.float64())})
    pq.write_table(table, tmp_path / "a.parquet")
    with caplog.at_level(logging.WARNING, logger="roll_envs.tasks.dataset"):
        problems, skipped = load_problems(tmp_path / "a.parquet")
    assert [p.answer for p in problems] == answers and skipped == missing
    assert "skipped 1 bad row(s): line 2: missing or empty 'answer'" in caplog.text
    # pandas' to_json of such a column writes 3.0 and null (and a NaN of its own, which is no answer either).
    lines = [json.dumps({"prompt": f"q{i}?", "answer": v}) for i, v in enumerate(values)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    problems, skipped = load_problems(tmp_path / "a.jsonl")
    assert [p.answer for p in problems] == answers and skipped == [*missing, (7, "'answer' is nan, not a number")]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset(table).save_to_disk(str(tmp_path / "ds"))
    assert [p.answer for p in load_problems(tmp_path / "ds")[0]] == answers


def test_held_out_rows_beyond_eval_size_are_said(caplog: pytest.LogCaptureFixture) -> None:
    """The hash split holds out ~eval_fraction of the rows and eval_size of them are evaluated: the rest are neither
    trained nor evaluated (9.9k of 100k rows at the defaults), which is now a warning with both counts; a split
    whose held-out rows are all evaluated says nothing."""
    import logging
    from types import SimpleNamespace

    from roll_envs.tasks.base import held_out_split, split_key, stable_fraction

    rows = [SimpleNamespace(prompt=f"problem {i}", answer=str(i)) for i in range(200)]
    held = sum(stable_fraction(split_key(r)) < 0.5 for r in rows)
    counts: dict[str, int] = {}
    with caplog.at_level(logging.WARNING, logger="roll_envs.tasks.base"):
        train, evaluated = held_out_split(rows, None, eval_fraction=0.5, eval_size=10, path="rows.jsonl", counts=counts)
    assert len(evaluated) == 10 and len(train) == 200 - held
    assert f"{held} rows fell in the held-out split" in caplog.text and f"the other {held - 10} are" in caplog.text
    # counted too: the run's summary and data/unused_held_out (roll_core.interfaces.tasks.data_counts)
    assert counts == {"also_held_out": 0, "unused_held_out": held - 10}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="roll_envs.tasks.base"):
        held_out_split(rows, None, eval_fraction=0.5, eval_size=held, path="rows.jsonl", counts=counts)
    assert "held-out split" not in caplog.text and counts["unused_held_out"] == 0
