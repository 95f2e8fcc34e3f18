"""The RLVR collector evaluates the first `pipeline.eval_size` held-out problems: the rows beyond them are neither
trained on nor evaluated, and count in `unused_held_out` (summary) and `data/unused_held_out` (every trained step),
added to the task's own count (a hash split beyond `env.eval_size`). The cut was silent: env.eval_path's 6 rows with
pipeline.eval_size=2 reported `unused_held_out` 0, so the summary did not add up to the rows the files hold."""

from __future__ import annotations

import json
from pathlib import Path

from roll_core.testing import run_pipeline, tiny_overrides


def _run(tmp_path: Path, *extra: str) -> tuple[dict, list[dict]]:
    rows = [json.dumps({"prompt": f"Q{i}: say 7", "answer": "7"}) for i in range(24)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(rows) + "\n")
    overrides = tiny_overrides(
        data,
        tmp_path / "run",
        "pipeline.max_steps=1",
        "algo.group_size=2",
        "pipeline.rollout_batch_size=2",
        "pipeline.trackers=[]",
        "cluster=local",
        *extra,
    )
    return run_pipeline(overrides)


def test_held_out_rows_beyond_pipeline_eval_size_are_counted(tmp_path: Path) -> None:
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"held {i}: say 7", "answer": "7"}) + "\n" for i in range(6)))
    summary, history = _run(tmp_path, f"env.eval_path={held}", "pipeline.eval_size=2")
    assert summary["unused_held_out"] == 4  # 6 held-out rows, 2 evaluated, none trained
    assert summary["also_held_out"] == 0
    steps = [h for h in history if h["step"] > 0]
    assert steps and all(h["data/unused_held_out"] == 4.0 for h in steps)


def test_the_cut_adds_to_the_tasks_own_count(tmp_path: Path) -> None:
    """A (stable) hash split of the 24 rows at env.eval_fraction=0.5 holds 14 out; env.eval_size=5 keeps 5 of them
    (the task counts the other 9) and pipeline.eval_size=3 evaluates 3: 11 held-out rows are unused."""
    summary, history = _run(tmp_path, "env.eval_fraction=0.5", "env.eval_size=5", "pipeline.eval_size=3")
    assert summary["unused_held_out"] == 9 + 2
    assert [h["data/unused_held_out"] for h in history if h["step"] > 0] == [11.0]
