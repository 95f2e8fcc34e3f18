"""The post-training collectors (pipeline=sft, dpo, distill_offline) sample the first `pipeline.eval_size` of the
env task's held-out problems for eval/accuracy: the problems beyond are neither trained on nor evaluated, and count
in the summary's `unused_held_out` and every step's `data/unused_held_out`, as the RLVR collector counts its cut
(test_eval_size_cut_counts.py; shared helper roll_core.pipelines.collectors._eval_cut). The cut was silent: the
env task's 6 held-out problems with pipeline.eval_size=2 left no `unused_held_out` at all. A tiny run of each
pipeline, 1 step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from roll_core.pipelines.collectors._eval_cut import first_eval_size, with_eval_cut
from roll_core.testing import run_pipeline
from roll_core.testing.posttrain_rows import write_jsonl

sys.path.insert(0, str(Path(__file__).parent))  # posttrain_tiny_runs, shared with test_posttrain_data_counts.py
from posttrain_tiny_runs import ROWS, N, tiny_posttrain_overrides


def _run(name: str, tmp_path: Path, *extra: str) -> tuple[dict, list[dict]]:
    """One step of pipeline `name` on N data rows; the env task holds 6 problems out (env.eval_path) and the run
    evaluates 2 of them (pipeline.eval_size=2, pipeline.eval_every=1)."""
    train = write_jsonl(tmp_path / "train.jsonl", [ROWS[name](i) for i in range(N)])
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"held {i}: say 7", "answer": "7"}) + "\n" for i in range(6)))
    evaluated = (f"env.eval_path={held}", "pipeline.eval_every=1", "pipeline.eval_size=2")
    return run_pipeline(tiny_posttrain_overrides(name, tmp_path, train, 12, *evaluated, *extra))


@pytest.mark.parametrize("name", list(ROWS))
def test_held_out_problems_beyond_pipeline_eval_size_are_counted(name: str, tmp_path: Path) -> None:
    summary, history = _run(name, tmp_path)
    assert summary["unused_held_out"] == 4  # 6 held-out problems, 2 evaluated, none trained
    assert summary["skipped_rows"] == {}  # the data files' counts stay theirs
    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1]
    assert steps[0]["data/unused_held_out"] == 4.0
    evals = [h for h in history if "eval/n" in h]
    assert evals and all(h["eval/n"] == 2.0 for h in evals)  # the 2 problems it did evaluate


@pytest.mark.parametrize(("name", "off"), [("sft", "sft.eval_task=false"), ("dpo", "dpo.generate_eval=false")])
def test_no_cut_is_counted_when_the_task_is_not_sampled(name: str, off: str, tmp_path: Path) -> None:
    """Without the task's accuracy evaluation its held-out problems are not read: nothing cut, nothing counted."""
    summary, history = _run(name, tmp_path, off, "pipeline.eval_every=0")
    assert "unused_held_out" not in summary
    assert all("data/unused_held_out" not in h for h in history)


def test_the_helpers() -> None:
    """`first_eval_size` slices and counts the rest; `with_eval_cut` adds the cut to the source's own count."""

    class Task:
        def __init__(self, unused: int | None) -> None:
            self.skipped_rows, self.also_held_out, self.unused_held_out = {"a.jsonl": 1}, 0, unused

    assert first_eval_size([1, 2, 3, 4, 5], 3) == ([1, 2, 3], 2)
    assert first_eval_size([1, 2], 3) == ([1, 2], 0)
    with pytest.raises(ValueError, match="eval_size must be >= 0"):
        first_eval_size([1, 2], -1)
    assert with_eval_cut(Task(9), 2) == {"skipped_rows": {"a.jsonl": 1}, "also_held_out": 0, "unused_held_out": 11}
    assert with_eval_cut(Task(None), 0) == {"skipped_rows": {"a.jsonl": 1}, "also_held_out": 0}
    assert with_eval_cut(Task(None), 4)["unused_held_out"] == 4


@pytest.mark.parametrize(("every", "warned"), [(0, False), (2, True)])
def test_an_sft_run_that_does_not_evaluate_does_not_warn_of_domains_its_cut_leaves_out(
    every: int, warned: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """sft.eval_task with pipeline.eval_every=0 evaluates nothing, yet a multi-domain task's cut (eval_size 2 of
    domains a, b, c) warned that c is not evaluated: the RLVR collector passes `evaluates`, the SFT one did not."""
    from types import SimpleNamespace

    from roll_core.pipelines.collectors.sft import SFTCollector
    from roll_core.posttrain.config import DataConfig
    from roll_core.posttrain.source import load_rows
    from roll_core.testing.chat_templates import family_tokenizer

    tok = family_tokenizer("tiny")
    train = write_jsonl(tmp_path / "train.jsonl", [ROWS["sft"](i) for i in range(N)])
    data = load_rows("sft", DataConfig(path=str(train)), tok, max_prompt_length=64, max_response_length=64, seed=0)
    task = SimpleNamespace(eval_set=lambda: [SimpleNamespace(domain=d) for d in "abcabc"])
    pipeline = SimpleNamespace(seed=0, rollout_batch_size=2, eval_size=2, eval_every=every)
    cfg = SimpleNamespace(pipeline=pipeline, sft=SimpleNamespace(eval_task=True), env=SimpleNamespace(name="multi"))
    with caplog.at_level("WARNING", logger="roll_core.pipelines.collectors._eval_cut"):
        collector = SFTCollector(SimpleNamespace(cfg=cfg, tokenizer=tok, task=task), data)
    assert [p.domain for p in collector.eval_problems] == ["a", "b"] and collector.eval_cut == 4
    said = [r.getMessage() for r in caplog.records if r.name == "roll_core.pipelines.collectors._eval_cut"]
    assert bool(said) == warned, said
    assert all("['c'] are not evaluated" in line for line in said)
