"""Resuming a run that has nothing left to do (roll_core.pipelines.loop): a finished rollout-only job relaunched with
pipeline.resume=true (a job script that always passes it) trains nothing, logs no step and writes no checkpoint. It
ran one more step with nothing to do, logged it and saved it as a new checkpoint, pruning an older one, at every
relaunch. The tiny model and the arithmetic task, in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from roll_core.tracking import Tracker


def _run(out: Path, *extra: str) -> tuple[Any, dict[str, Any]]:
    from roll_core.cli import pipeline_class
    from roll_core.config import load_config

    cfg = load_config(
        [
            "pipeline=rollout",
            "model=tiny",
            "model.max_response_length=4",
            "env=arithmetic",
            "env.train_size=10",
            "env.eval_size=4",
            "pipeline.rollout_batch_size=3",
            "pipeline.progress=false",
            "pipeline.trackers=[]",
            f"pipeline.output_dir={out}",
            "rollout.samples_per_prompt=1",
            "rollout.max_prompts=6",
            *extra,
        ]
    )
    pipeline = pipeline_class(cfg.pipeline.name)(cfg)
    try:
        return pipeline, pipeline.run()
    finally:
        pipeline.shutdown()


def test_a_finished_rollout_job_resumed_trains_nothing_and_saves_nothing(tmp_path: Path) -> None:
    _, first = _run(tmp_path)
    assert first["status"] == "finished" and first["rollout"]["prompts_done"] == 6
    rows = (tmp_path / "rollout.jsonl").read_bytes()
    pipeline, again = _run(tmp_path, "pipeline.resume=true")
    assert pipeline.start_step == 3
    assert [h["step"] for h in Tracker.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]
    assert again["status"] == "finished" and not again.get("incomplete")
    assert (tmp_path / "rollout.jsonl").read_bytes() == rows
