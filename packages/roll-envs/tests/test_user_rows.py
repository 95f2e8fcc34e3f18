"""A user's own data rows through the file-backed tasks: chat-message prompts, the `domain` column, byte order
marks, ids of a held-out file named like the training file; and distinct generated countdown problems."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from roll_envs.rewards.ifeval import InstructionReward
from roll_envs.rewards.math import MathReward
from roll_envs.tasks import ArithmeticTask, CodeTask, CountdownReward, CountdownTask, FileTask, load_problems
from roll_envs.tasks.instruct import InstructTask
from roll_envs.tasks.multi import MultiTask


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "Put the final answer in \\boxed{}."},
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "\\boxed{2}"},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "an answer turn, not shown"},
    ]


def test_chat_prompt_rows_keep_their_system_message_and_earlier_turns(tmp_path: Path) -> None:
    """verl's prepared rows "load as they are": the row's system prompt and few-shot turns reach the model (they
    were dropped, leaving only the last user message)."""
    rows = [{"prompt": _chat(f"What is {i} + 2?"), "answer": str(i + 2)} for i in range(20)]
    path = _write(tmp_path / "chat.jsonl", rows)
    task = FileTask(MathReward(), path=str(path), eval_fraction=0.0)
    p = task.train_set()[3]
    assert p.prompt == "What is 3 + 2?"
    assert task.messages(p) == _chat("What is 3 + 2?")[:4]
    # a set env.system_prompt replaces the row's own (one system message: templates refuse a second)
    own = FileTask(MathReward(), path=str(path), eval_fraction=0.0, system_prompt="Be brief.")
    msgs = own.messages(own.train_set()[3])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"] == "Be brief."


def test_chat_prompt_rows_with_messages_that_are_not_text_turns_are_counted_skips(tmp_path: Path) -> None:
    good = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}
    rows = [
        good,
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "user", "content": "q"}]},
        {"prompt": [{"role": "tool", "content": "x"}, {"role": "user", "content": "q"}], "answer": "1"},
        {"prompt": [{"role": "user", "content": "q"}, {"role": "system", "content": "late"}, good["prompt"][0]]},
        {"prompt": [{"role": "system", "content": "only a system message"}], "answer": "1"},
    ]
    rows[1]["answer"] = rows[3]["answer"] = "1"
    problems, skipped = load_problems(_write(tmp_path / "chat.jsonl", rows))
    assert [p.prompt for p in problems] == ["What is 2 + 2?"] and problems[0].context == ()
    assert skipped == [
        (2, "'prompt' has type list (message 0: list content), expected text"),
        (3, "message 0 of 'prompt' has role 'tool' (role 'tool' unknown)"),
        (4, "message 1 of 'prompt' has role 'system' (roles are system (first), user, assistant)"),
        (5, "'prompt' is chat messages without a user message"),
    ]


def test_a_null_or_empty_domain_column_is_no_domain(tmp_path: Path) -> None:
    """A Parquet column with nulls (rows of several sources) gave those rows the domain "None"; a number is a bad
    row, named."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {"prompt": "a", "answer": "1", "domain": "geo"},
        {"prompt": "b", "answer": "2", "domain": None},
        {"prompt": "c", "answer": "3", "domain": "  "},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    problems, skipped = load_problems(tmp_path / "d.parquet")
    assert [p.domain for p in problems] == ["geo", "math", "math"] and not skipped
    bad = [*rows, {"prompt": "d", "answer": "4", "domain": 3}, {"prompt": "e", "answer": "5", "domain": float("nan")}]
    problems, skipped = load_problems(_write(tmp_path / "d.jsonl", bad))
    assert [p.domain for p in problems] == ["geo", "math", "math", "math"]
    assert skipped == [(4, "'domain' has type int (3), expected text")]
    ifeval = [{"prompt": "Say hi.", "constraints": [{"type": "no_commas"}], "domain": None}] * 12
    task = InstructTask(InstructionReward(), path=str(_write(tmp_path / "if.jsonl", ifeval)), eval_fraction=0.0)
    assert {p.domain for p in task.train_set()} == {"instruct"}


@pytest.mark.parametrize("layout", ["jsonl", "json-array-one-row-a-line"])
def test_a_byte_order_mark_costs_no_rows(tmp_path: Path, layout: str) -> None:
    """Files saved by Windows editors start with a UTF-8 BOM: the first JSONL row was a bad row, and a JSON array
    written one row a line was read as lines, every row but the last bad."""
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    if layout == "jsonl":
        text, path = "".join(json.dumps(r) + "\n" for r in rows), tmp_path / "rows.jsonl"
    else:
        text, path = "[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n", tmp_path / "rows.json"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    problems, skipped = load_problems(path)
    assert [p.answer for p in problems] == [str(i + 1) for i in range(6)] and skipped == []


def test_column_routing_gives_rows_without_a_domain_their_sub_tasks_reward(tmp_path: Path) -> None:
    """route=column: a file row naming no domain had the file task's default "math", so it was scored by the
    reward of whichever sub-task is called math (the file task's own reward unused, its rows mixed into math's
    share and metrics)."""

    class QAReward(MathReward):
        pass

    rows = [{"prompt": f"Capital of country {i}?", "answer": f"city {i}"} for i in range(40)]
    rows += [{"prompt": f"Geometry {i}?", "answer": str(i), "domain": "geo"} for i in range(10)]
    path = _write(tmp_path / "qa.jsonl", rows)
    qa = FileTask(QAReward(), path=str(path))
    math_task = ArithmeticTask(MathReward(), train_size=20, eval_size=5)
    multi = MultiTask({"math": math_task, "qa": qa}, route="column", rewards={"geo": MathReward()})
    assert sorted(multi.domains) == ["geo", "math", "qa"]
    assert isinstance(multi.reward.rewards["qa"], QAReward)
    by_domain = {d: sum(p.domain == d for p in multi.train_set()) for d in multi.domains}
    assert by_domain["math"] == 20 and by_domain["qa"] + by_domain["geo"] == len(qa.train_set())
    assert by_domain["geo"] == sum(p.prompt.startswith("Geometry") for p in qa.train_set())
    assert {p.domain for p in multi.eval_set() if p.prompt.startswith("Capital")} <= {"qa"}


def test_a_held_out_file_named_like_the_training_file_has_its_own_ids(tmp_path: Path) -> None:
    """train/data.jsonl and test/data.jsonl: both files' line 1 was `data:data.jsonl:1`, a held-out problem with a
    training problem's id."""
    for split, lo in (("train", 0), ("test", 100)):
        (tmp_path / split).mkdir()
        rows = [
            {"prompt": f"What is {i} + 1?", "answer": str(i + 1), "tests": [{"input": "1\n", "output": "1\n"}]}
            | {"constraints": [{"type": "no_commas"}]}
            for i in range(lo, lo + 20)
        ]
        _write(tmp_path / split / "data.jsonl", rows)
    train, test = str(tmp_path / "train" / "data.jsonl"), str(tmp_path / "test" / "data.jsonl")
    tasks = [
        FileTask(MathReward(), path=train, eval_path=test),
        CodeTask(MathReward(), path=train, eval_path=test),
        InstructTask(InstructionReward(), path=train, eval_path=test),
    ]
    for task in tasks:
        train_ids, held_ids = {p.id for p in task.train_set()}, {p.id for p in task.eval_set()}
        assert len(train_ids) == 20 and len(held_ids) == 20 and not train_ids & held_ids, type(task).__name__
        assert f"{task.name}:data.jsonl:1" in train_ids and f"{task.name}:eval:data.jsonl:1" in held_ids
    # an evaluation set (the same file twice) keeps its ids
    same = FileTask(MathReward(), path=train, eval_path=train)
    assert [p.id for p in same.eval_set()] == [p.id for p in same.train_set()][:20]


def test_code_rows_read_chat_prompts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A chat-message prompt was skipped as "missing or empty 'prompt'" (env=file reads it)."""
    rows = [{"prompt": _chat(f"Print {i}.")[:4], "tests": [{"input": "", "output": f"{i}\n"}]} for i in range(30)] + [
        {"prompt": 7, "tests": [{"input": "", "output": "7\n"}]}
    ]
    with caplog.at_level(logging.WARNING):
        task = CodeTask(MathReward(), path=str(_write(tmp_path / "code.jsonl", rows)))
    problems = task.train_set() + task.eval_set()
    assert len(problems) == 30 and task.skipped == [
        (str(tmp_path / "code.jsonl"), 31, "'prompt' has type int (7), expected text")
    ]
    p = next(p for p in problems if p.prompt == "Print 4.")
    assert task.messages(p) == _chat("Print 4.")[:4]


def test_countdown_splits_hold_distinct_problems() -> None:
    """Repeats were kept as drawn: the default 2000 training problems held 1209 distinct ones and the 100
    held-out 89, some weighed twice in held-out accuracy."""
    task = CountdownTask(CountdownReward(), train_size=2000, eval_size=100)
    for split in (task.train_set(), task.eval_set()):
        assert len({p.id for p in split}) == len(split)
    assert not {p.id for p in task.train_set()} & {p.id for p in task.eval_set()}
    again = CountdownTask(CountdownReward(), train_size=2000, eval_size=100)
    assert [p.prompt for p in again.train_set()] == [p.prompt for p in task.train_set()]
    # a space smaller than the split repeats its problems rather than fail
    tiny = CountdownTask(CountdownReward(), num_numbers=2, max_number=3, train_size=50, eval_size=10, eval_fraction=0.5)
    assert len(tiny.train_set()) == 50 and len({p.id for p in tiny.train_set()}) < 50


def test_decimal_answers_are_plain_decimals(tmp_path: Path) -> None:
    """A Parquet decimal column (SQL exports) was a bad row ("has type Decimal"): every row skipped."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import decimal

    values = [decimal.Decimal("12.50"), decimal.Decimal("-3"), decimal.Decimal("0.000001")]
    table = pa.table({"prompt": ["a", "b", "c"], "answer": pa.array(values, pa.decimal128(10, 6))})
    pq.write_table(table, tmp_path / "dec.parquet")
    problems, skipped = load_problems(tmp_path / "dec.parquet")
    # (the scale's padding dropped, as a float column's 12.5 and -3.0 read: test_data_rows_ambiguous.py)
    assert [p.answer for p in problems] == ["12.5", "-3", "0.000001"] and not skipped


def test_a_datasets_folder_with_several_splits_says_which_it_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    datasets = pytest.importorskip("datasets")
    rows = {s: [{"prompt": f"{s} {i}", "answer": str(i)} for i in range(5)] for s in ("train", "test")}
    datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in rows.items()}).save_to_disk(tmp_path / "ds")
    with caplog.at_level(logging.WARNING):
        problems, _ = load_problems(tmp_path / "ds")
    assert [p.prompt for p in problems] == [f"train {i}" for i in range(5)]
    assert "holds the splits ['test', 'train']: reading 'train' only" in caplog.text


def test_arithmetic_worked_examples_with_a_colon_in_the_task_name() -> None:
    task = ArithmeticTask(MathReward(), name="math:easy", train_size=10, eval_size=5, examples=2)
    for question, answer in task.examples:
        expr = question.removeprefix("What is ").split("?")[0]
        assert answer.startswith(f"{expr} = "), (question, answer)


def test_held_out_rows_of_a_domain_no_training_row_has_are_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train = _write(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "answer": "1", "domain": "a"} for i in range(20)])
    held = _write(tmp_path / "held.jsonl", [{"prompt": f"h{i}", "answer": "1", "domain": "b"} for i in range(3)])
    with caplog.at_level(logging.WARNING):
        multi = MultiTask({"a": FileTask(MathReward(), path=str(train), eval_path=str(held))}, route="column")
    assert multi.eval_set() == [] and "held-out rows of domain(s) {'b': 3}" in caplog.text
    assert multi.unused_held_out == 3  # counted too: the run's summary and data/unused_held_out


def test_held_out_rows_neither_trained_nor_evaluated_are_counted(tmp_path: Path) -> None:
    """A file's hash split beyond env.eval_size is idle (only logged before): FileTask counts it in
    `unused_held_out` (roll_core.interfaces.tasks.data_counts puts it in the run's summary and metrics), env=multi
    adds its sub-tasks'; env.eval_path's rows were never training rows (0); generated tasks have none (None)."""
    from roll_core.interfaces.tasks import data_counts

    path = _write(tmp_path / "rows.jsonl", [{"prompt": f"q{i}", "answer": "1"} for i in range(400)])
    task = FileTask(MathReward(), path=str(path), eval_fraction=0.5, eval_size=10)
    held = 400 - len(task.train_set())
    assert len(task.eval_set()) == 10 and held > 100 and task.unused_held_out == held - 10
    assert data_counts(task)["unused_held_out"] == held - 10
    other = _write(tmp_path / "held.jsonl", [{"prompt": f"h{i}", "answer": "1"} for i in range(30)])
    given = FileTask(MathReward(), path=str(path), eval_path=str(other), eval_size=10)
    assert len(given.eval_set()) == 10 and given.unused_held_out == 0
    assert MultiTask({"a": task, "b": given}).unused_held_out == held - 10
    generated = ArithmeticTask(MathReward())
    assert generated.unused_held_out is None and "unused_held_out" not in data_counts(generated)
