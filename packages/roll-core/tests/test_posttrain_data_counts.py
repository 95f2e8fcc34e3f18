"""Post-training runs report their data counts as RLVR runs do (roll_core.interfaces.tasks.DataCounts): the run
summary's `skipped_rows` (bad rows of data.path and data.eval_path, by reason) and `also_held_out` (training
examples whose prompt data.eval_path holds too: kept and trained on, counted), and every step's
`data/skipped_rows` and `data/also_held_out`. The overlap was only logged once at load; DPO logged no skip count
per step and left the held-out file's skips out of its summary (so did offline distillation), and SFT's step
metric counted data.path's skips only while its summary counted both files. A tiny run of each pipeline, 1 step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from roll_core.interfaces import DataCounts
from roll_core.interfaces.tasks import data_counts
from roll_core.testing import run_pipeline
from roll_core.testing.chat_templates import family_tokenizer
from roll_core.testing.posttrain_rows import load, write_jsonl

sys.path.insert(0, str(Path(__file__).parent))  # posttrain_tiny_runs, shared with test_posttrain_eval_size_cut.py
from posttrain_tiny_runs import ROWS, N, tiny_posttrain_overrides

EXTRA = {"sft": [], "dpo": [], "distill_offline": ["distill.eval_task=false"]}


def _files(make, folder: Path) -> tuple[str, str]:
    """N training examples; prompts 0 and 1 are held out too, one bad line in each file."""
    train = write_jsonl(folder / "train.jsonl", [*(make(i) for i in range(N)), "{not json"])
    held = write_jsonl(folder / "held.jsonl", [make(0), make(1), make(N + 5), "{not json"])
    return train, held


@pytest.mark.parametrize("name", list(ROWS))
def test_a_post_training_run_reports_its_data_counts(name: str, tmp_path: Path) -> None:
    train, held = _files(ROWS[name], tmp_path)
    overrides = tiny_posttrain_overrides(name, tmp_path, train, 20, f"data.eval_path={held}", *EXTRA[name])
    summary, history = run_pipeline(overrides)
    assert summary["also_held_out"] == 2  # Q0 and Q1: kept and trained on, but counted
    assert summary["skipped_rows"] == {"unreadable": 2}  # one bad line in each file
    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1]
    assert steps[0]["data/also_held_out"] == 2.0 and steps[0]["data/skipped_rows"] == 2.0
    if name == "dpo":  # the pair-building counts stay where they were
        assert summary["pair_stats"]["also_held_out"] == 2


def test_the_counts_of_each_split(tmp_path: Path) -> None:
    """`PostTrainData` as DataCounts: no held-out rows, nothing to count (None, as a task that draws disjoint
    splits); a data.eval_size split keeps a prompt's rows on one side (0)."""
    tok = family_tokenizer("tiny")
    path = write_jsonl(tmp_path / "rows.jsonl", [ROWS["sft"](i % 6) for i in range(24)])
    alone, split = load("sft", tok, path=path), load("sft", tok, path=path, eval_size=4)
    assert isinstance(alone, DataCounts) and alone.also_held_out is None
    assert data_counts(alone) == {"skipped_rows": {}}
    assert data_counts(split) == {"skipped_rows": {}, "also_held_out": 0} and len(split.eval) >= 4
    assert {x.key for x in split.train.items}.isdisjoint({x.key for x in split.eval.items})
