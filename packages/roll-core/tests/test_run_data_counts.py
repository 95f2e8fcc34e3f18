"""What a task's data lost reaches the run: the training rows a file task leaves out because a held-out row is the
same problem but for whitespace (`also_held_out`) and the bad rows it skipped (`skipped_rows`) are in every trained
step's metrics (`data/also_held_out`, `data/skipped_rows`) and in the run summary, for RLVR and the agentic
collectors alike, read through the optional `DataCounts` of roll_core.interfaces.tasks. The count was set on the
task and logged once, but no metric or summary carried it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from roll_core.interfaces.tasks import DataCounts, data_counts, data_metrics
from roll_core.testing import run_pipeline, tiny_overrides


def test_data_counts_reads_the_optional_attributes_and_refuses_wrong_types() -> None:
    assert data_counts(SimpleNamespace()) == {"skipped_rows": {}}  # a task that says nothing
    task = SimpleNamespace(skipped_rows={"a.jsonl": np.int64(2)}, also_held_out=np.int64(3))
    assert isinstance(task, DataCounts)
    counts = data_counts(task)
    assert counts == {"skipped_rows": {"a.jsonl": 2}, "also_held_out": 3} and type(counts["also_held_out"]) is int
    assert data_metrics(counts) == {"data/skipped_rows": 2.0, "data/also_held_out": 3.0}
    # None: nothing to count (generated problems, seeded environments), not 0
    assert data_counts(SimpleNamespace(also_held_out=None)) == {"skipped_rows": {}}
    assert data_metrics(data_counts(SimpleNamespace())) == {"data/skipped_rows": 0.0}
    for bad in (True, -1, 2.5, "3"):
        with pytest.raises(TypeError, match=r"SimpleNamespace\.also_held_out must be a row count"):
            data_counts(SimpleNamespace(also_held_out=bad))
    with pytest.raises(TypeError, match=r"skipped_rows must map data files to row counts"):
        data_counts(SimpleNamespace(skipped_rows={"a.jsonl": "4"}))
    # held-out rows neither trained nor evaluated (a hash split beyond env.eval_size), when the task counts them
    idle = data_counts(SimpleNamespace(also_held_out=0, unused_held_out=np.int64(40)))
    assert idle == {"skipped_rows": {}, "also_held_out": 0, "unused_held_out": 40}
    assert data_metrics(idle) == {"data/skipped_rows": 0.0, "data/also_held_out": 0.0, "data/unused_held_out": 40.0}
    with pytest.raises(TypeError, match=r"SimpleNamespace\.unused_held_out must be a row count"):
        data_counts(SimpleNamespace(unused_held_out=-2))


def test_an_rlvr_run_reports_the_rows_left_out_as_held_out(tmp_path: Path) -> None:
    """env=file with env.eval_path holding whitespace twins of three training prompts ("Q3: say 7\\n", a doubled
    space) and one bad line: the summary and the step's metrics say 3 rows left out, 1 row skipped."""
    rows = [json.dumps({"prompt": f"Q{i}: say 7", "answer": "7"}) for i in range(24)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([*rows, "{not json"]) + "\n")
    held = [f"Q{i}: say 7\n" for i in (3, 4)] + ["Q5:  say 7", "held-out only: say 7"]
    eval_path = tmp_path / "held.jsonl"
    eval_path.write_text("".join(json.dumps({"prompt": p, "answer": "7"}) + "\n" for p in held))
    overrides = tiny_overrides(
        data,
        tmp_path / "run",
        f"env.eval_path={eval_path}",
        "pipeline.max_steps=1",
        "algo.group_size=2",
        "pipeline.rollout_batch_size=2",
        "pipeline.trackers=[]",
        "cluster=local",
    )
    summary, history = run_pipeline(overrides)
    assert summary["also_held_out"] == 3
    assert summary["skipped_rows"] == {str(data): 1}
    assert summary["unused_held_out"] == 0  # env.eval_path's rows are evaluated or were never training rows
    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1]
    assert all(h["data/also_held_out"] == 3.0 and h["data/skipped_rows"] == 1.0 for h in steps)


def test_the_agentic_collectors_report_the_tasks_counts() -> None:
    """pipeline=agentic (a skyrl:<id> task's rows) and pipeline=agent (env=openai_agent's rows) report them too;
    their summaries were empty."""
    from roll_core.pipelines.collectors.agents import AgentCollector
    from roll_core.pipelines.collectors.episodes import EpisodeCollector
    from roll_core.pipelines.metrics import StepLog

    episodes = EpisodeCollector.__new__(EpisodeCollector)  # what `summary` and `collected` read
    episodes.task = SimpleNamespace(on_failure="score", also_held_out=4)
    episodes.envs, episodes._counters = SimpleNamespace(counters=dict), {}
    episodes.ctx = SimpleNamespace(samples=lambda step, rows: None)
    assert episodes.summary() == {"skipped_rows": {}, "also_held_out": 4}
    out = StepLog()
    assert episodes.collected(1, [], out) is None  # an empty step logs the counts too
    assert out["data/also_held_out"] == 4.0 and out["data/skipped_rows"] == 0.0

    agents = AgentCollector.__new__(AgentCollector)
    agents.task = SimpleNamespace(also_held_out=2)
    assert agents.summary() == {"skipped_rows": {}, "also_held_out": 2}
    agents.task = SimpleNamespace()  # a seeded task: nothing to count
    assert agents.summary() == {"skipped_rows": {}}
