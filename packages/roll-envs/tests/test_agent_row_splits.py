"""Held-out splits of agent task rows (env=openai_agent, skyrl:<id>) follow env=file's rule: a training row that is a
held-out row but for whitespace in its strings ("Q?" and "Q?\\n": one task to the agent) is left out of training,
counted (`also_held_out`) and logged; the sides are still decided by the row's JSON hash, so a resumed run keeps its
split. An exact-JSON check and a raw hash split trained on such twins of held-out rows."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from roll_core.interfaces.tasks import data_counts
from roll_envs.agentic.openai_agent import OpenAIAgentTask
from roll_envs.tasks.base import stable_fraction


def row_key(row: dict[str, Any]) -> str:
    """The hash text that decided a row's side before (it must not move: a resumed run keeps its split)."""
    return json.dumps(row, sort_keys=True, default=str)


def _loose(row: Any) -> Any:
    """A row with every string's whitespace collapsed: what makes two rows one task."""
    if isinstance(row, str):
        return " ".join(row.split())
    if isinstance(row, dict):
        return {k: _loose(v) for k, v in row.items()}
    if isinstance(row, list):
        return [_loose(v) for v in row]
    return row


def _keys(rows: list[dict[str, Any]]) -> set[str]:
    return {json.dumps(_loose(r), sort_keys=True) for r in rows}


def _write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _twinned_rows(n: int) -> list[dict[str, Any]]:
    """`n` tasks, each also written with a trailing newline and (nested in chat messages) with doubled spaces."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        task = f"Add {i} and {i}, then report the sum."
        rows.append({"task": task, "messages": [{"role": "user", "content": task}], "n": i})
        rows.append({"task": task + "\n", "messages": [{"role": "user", "content": task}], "n": i})
        spaced = task.replace(" and ", "  and\t")
        rows.append({"task": task, "messages": [{"role": "user", "content": spaced}], "n": i})
    return rows


def test_openai_agent_leaves_out_whitespace_twins_of_held_out_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hash split of the rows' JSON put a task and its copy with a trailing newline (or doubled spaces in a
    message) on different sides: the held-out task was trained on."""
    rows = _twinned_rows(200)
    data = _write(tmp_path / "rows.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        task = OpenAIAgentTask(command=["true"], path=data, eval_fraction=0.2, eval_size=1000)
    train, held = task.train_rows(len(task._train), seed=0), task.eval_rows()
    assert len(held) > 20 and not _keys(held) & _keys(train)
    # The sides are the row JSON's hash as before: nothing moved between them, twins only left training.
    assert all(stable_fraction(row_key(r)) < 0.2 for r in held)
    assert all(stable_fraction(row_key(r)) >= 0.2 for r in train)
    assert len(held) == sum(stable_fraction(row_key(r)) < 0.2 for r in rows)
    dropped = 600 - len(train) - len(held)
    assert dropped > 0 and task.also_held_out == dropped
    assert caplog.text.count("but for whitespace") == 1
    assert f"{dropped} of its 600 rows repeat a held-out row's prompt but for whitespace" in caplog.text
    # Exact repeats only: nothing left out, nothing said.
    caplog.clear()
    plain = _write(tmp_path / "plain.jsonl", rows[::3] * 2)
    with caplog.at_level(logging.WARNING):
        exact = OpenAIAgentTask(command=["true"], path=plain, eval_fraction=0.2)
    assert exact.also_held_out == 0 and "but for whitespace" not in caplog.text


def test_openai_agent_leaves_out_whitespace_twins_of_eval_path_rows(tmp_path: Path) -> None:
    """env.eval_path holding tasks with other whitespace: every training copy of them is left out and counted (an
    exact-JSON check left them all in)."""
    rows = _twinned_rows(200)
    data = _write(tmp_path / "rows.jsonl", rows)
    bench = _write(tmp_path / "bench.jsonl", [{**r, "task": " " + r["task"] + "  "} for r in rows[:15:3]])
    with_bench = OpenAIAgentTask(command=["true"], path=data, eval_path=bench)
    assert len(with_bench.eval_rows()) == 5 and not _keys(with_bench.eval_rows()) & _keys(with_bench._train)
    assert with_bench.also_held_out == 15 and len(with_bench._train) == 585
    # env.path = env.eval_path is an evaluation set, as for env=file: every row is both (it was "every row fell in
    # the held-out split").
    same = OpenAIAgentTask(command=["true"], path=data, eval_path=data, eval_size=1000)
    assert len(same._train) == len(same.eval_rows()) == 600 and same.also_held_out == 0


def test_openai_agent_counts_held_out_rows_neither_trained_nor_evaluated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hash split's held-out rows past env.eval_size are neither trained nor evaluated: counted in
    `unused_held_out` (the run's data/unused_held_out and summary, as env=file reports them) and logged; they were
    dropped without a word. A split that evaluates all its held-out rows, and env.eval_path's rows, count 0."""
    rows = _twinned_rows(200)
    data = _write(tmp_path / "rows.jsonl", rows)
    held = sum(stable_fraction(row_key(r)) < 0.2 for r in rows)
    with caplog.at_level(logging.WARNING):
        task = OpenAIAgentTask(command=["true"], path=data, eval_fraction=0.2, eval_size=10)
    assert held > 20 and len(task.eval_rows()) == 10 and task.unused_held_out == held - 10
    assert f"the other {held - 10} are neither trained nor evaluated" in caplog.text
    assert data_counts(task)["unused_held_out"] == held - 10
    assert OpenAIAgentTask(command=["true"], path=data, eval_fraction=0.2, eval_size=1000).unused_held_out == 0
    bench = _write(tmp_path / "bench.jsonl", rows[:30])
    assert OpenAIAgentTask(command=["true"], path=data, eval_path=bench, eval_size=10).unused_held_out == 0
    assert OpenAIAgentTask(command=["true"], path=data, eval_path=data, eval_size=10).unused_held_out == 0


def _skyrl_rows(n: int) -> list[dict[str, Any]]:
    """`n` gsm8k-style rows, each also written with a trailing newline."""
    rows = []
    for i in range(n):
        prompt = f"What is {i} + 1? End with #### ANSWER."
        extras = {"reward_spec": {"ground_truth": str(i + 1)}, "max_turns": 3}
        rows += [{"prompt": prompt, "extras": extras}, {"prompt": prompt + "\n", "extras": extras}]
    return rows


def test_skyrl_leaves_out_whitespace_twins_of_held_out_rows(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("skyrl_gym", exc_type=ImportError)
    from roll_envs.agentic import make_env

    rows = _skyrl_rows(60)
    with caplog.at_level(logging.WARNING):
        env = make_env("skyrl:gsm8k_multi_turn", rows=rows, eval_fraction=0.3)
    assert len(env.held_out) > 5 and not _keys(env.held_out) & _keys(env.rows)
    assert all(stable_fraction(row_key(r)) < 0.3 for r in env.held_out)
    assert all(stable_fraction(row_key(r)) >= 0.3 for r in env.rows)
    dropped = 120 - len(env.rows) - len(env.held_out)
    assert dropped > 0 and env.also_held_out == dropped
    assert f"{dropped} of its 120 rows repeat a held-out row's prompt but for whitespace" in caplog.text


def test_skyrl_leaves_out_whitespace_twins_of_given_held_out_rows() -> None:
    """Given held-out rows (eval_rows / eval_data_file) with other whitespace: both training copies are left out."""
    pytest.importorskip("skyrl_gym", exc_type=ImportError)
    from roll_envs.agentic import make_env

    rows = _skyrl_rows(60)
    held = [{**r, "prompt": r["prompt"].replace(" + ", "  +  ")} for r in rows[:10:2]]
    given = make_env("skyrl:gsm8k_multi_turn", rows=rows, eval_rows=held)
    assert not _keys(given.held_out) & _keys(given.rows)
    assert given.also_held_out == 10 and len(given.rows) == 110
    # The agentic task reports its environment's count (roll_core.interfaces.tasks.DataCounts: the run's metrics
    # and summary); a seeded game has none to report.
    from roll_envs.agentic.task import AgenticTask

    task = AgenticTask("skyrl:gsm8k_multi_turn", env_kwargs={"rows": rows, "eval_rows": held}, eval_size=5)
    assert task.also_held_out == 10
    assert AgenticTask("guess_number", eval_size=4).also_held_out is None
    # Held-out rows neither trained nor evaluated: none (every held-out row is a held-out seed's choice), and said so
    # (a dataset-backed environment's 0, like env=file's); a seeded game has none to report.
    assert given.unused_held_out == 0 and task.unused_held_out == 0
    assert data_counts(task) == {"skipped_rows": {}, "also_held_out": 10, "unused_held_out": 0}
    assert AgenticTask("guess_number", eval_size=4).unused_held_out is None
    # Training seeds never pick a twin of a held-out row.
    prompts = {" ".join(given.reset(seed=s)[0].split()) for s in range(200)}
    assert not prompts & {" ".join(r["prompt"].split()) for r in held}


def test_split_rows_is_held_out_splits_rule_with_the_same_sides() -> None:
    """split_rows repeated held_out_split's hash branch with its own hash text; it now calls the shared function
    with `key=` (one rule). Which rows land on which side must not move (a resumed run keeps its split): these
    indices are what the repeated branch gave for this input."""
    from roll_envs.agentic.openai_agent import split_rows

    rows: list[dict[str, Any]] = [{"task": f"Solve puzzle {i}.", "n": i} for i in range(24)]
    rows += [{"task": f"Solve puzzle {i}.\n", "n": i} for i in range(0, 24, 3)]  # whitespace twins: rows 24-31
    index = {id(r): i for i, r in enumerate(rows)}
    counts: dict[str, int] = {}
    train, held = split_rows(rows, None, eval_fraction=0.3, eval_size=100, source="pin", counts=counts)
    assert [index[id(r)] for r in held] == [1, 3, 6, 8, 23, 24, 26, 28, 31]
    # 0, 12, 21 and 25 are whitespace twins of held-out rows (24, 28, 31 and 3): left out of training
    assert [index[id(r)] for r in train] == [2, 4, 5, 7, 9, 10, 11, *range(13, 21), 22, 27, 29, 30]
    assert counts == {"also_held_out": 4, "unused_held_out": 0}
    counts = {}
    train, held = split_rows(rows, None, eval_fraction=0.3, eval_size=3, source="pin", counts=counts)
    assert [index[id(r)] for r in held] == [1, 3, 6] and len(train) == 19
    assert counts == {"also_held_out": 4, "unused_held_out": 6}


def test_held_out_split_takes_the_hash_key() -> None:
    """The shared split hashes what `key` gives (split_key by default): the row splits' hash text is a row's JSON."""
    from dataclasses import dataclass

    from roll_envs.tasks.base import held_out_split

    @dataclass(frozen=True)
    class P:
        prompt: str
        tag: str

    problems = [P(f"Q{i}", f"t{i}") for i in range(40)]
    train, held = held_out_split(problems, None, eval_fraction=0.4, eval_size=40, path="p", key=lambda p: p.tag)
    assert held == [p for p in problems if stable_fraction(p.tag) < 0.4]
    assert train == [p for p in problems if stable_fraction(p.tag) >= 0.4]
    assert held != [p for p in problems if stable_fraction(p.prompt) < 0.4]  # not the prompt's hash
    counts: dict[str, int] = {}  # an evaluation set (path = eval_path) counts nothing left out
    held_out_split(problems, problems, eval_fraction=0.4, eval_size=5, path="p", eval_path="p", counts=counts)
    assert counts == {"also_held_out": 0, "unused_held_out": 0}
