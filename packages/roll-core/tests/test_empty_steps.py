"""Steps that train nothing (roll_core.pipelines.empty_steps): a collector whose `next` returns None every step (an
engine failing every request, every episode aborted, every group filtered) let the run complete with exit 0 having
trained nothing. Now each such step is warned about with the reason its metrics give and counted in
`data/empty_steps`, `pipeline.max_empty_steps` of them in a row stop the run with `EmptyStepsError` (the step
logged first), a step that trains resets the streak, 0 never stops, and a collector's by-design None
(`empty_by_design`: rollout-only, a warm-up) is never counted. The loop runs for real (`Pipeline.run`) with a real
tracker; the collector, trainer and cluster are stand-ins."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.config.compose import load_config
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.empty_steps import EmptySteps, EmptyStepsError
from roll_core.pipelines.loop import Pipeline
from roll_core.protocol import Batch
from roll_core.tracking import Tracker

#: What pipeline=agent's step writes when the engine failed every request of its 4 episodes.
ENGINE_DOWN = {"data/dropped_episodes": 4, "data/aborted_episodes": 4, "agent/engine_errors": 4.0}
BATCH, WARMUP, EMPTY = "batch", "warmup", None


class _Collector:
    """Returns, step by step, a batch (`BATCH`), None by design (`WARMUP`) or None (`EMPTY`), writing `metrics`."""

    plot_keys: tuple[str, ...] = ()
    trajectories = False

    def __init__(self, script: list[Any], metrics: dict[str, float] | None = None) -> None:
        self.script, self.metrics = list(script), metrics or {}
        self.empty_by_design = False

    def next(self, step: int, out: Any) -> Collected | None:
        what = self.script[step - 1]
        self.empty_by_design = what == WARMUP
        if what == BATCH:
            out["reward/mean"] = 0.5
            return Collected(Batch({"x": torch.zeros(2, 1)}), torch.zeros(2))
        out.update(self.metrics)
        return None

    def evaluate(self, step: int) -> dict[str, float]:
        return {}

    def summary(self) -> dict[str, Any]:
        return {}


class _Trainer:
    stale, bad_steps, scaler_streak = False, 0, 0

    def __init__(self) -> None:
        self.updated: list[int] = []

    def update(self, step: int, collected: Collected, out: Any) -> None:
        self.updated.append(step)

    def sync_weights(self, collector: Any, out: Any) -> None:
        pass


def _pipeline(tmp_path: Path, collector: Any, max_empty_steps: int, max_steps: int) -> Pipeline:
    """A Pipeline around `collector` whose every other part is a stand-in (a real tracker in `tmp_path`)."""
    p = Pipeline.__new__(Pipeline)
    pipe = SimpleNamespace(
        eval_every=0,
        max_steps=max_steps,
        save_every=0,
        progress=False,
        max_nonfinite_steps=3,
        max_loss_scale_skips=32,
        max_empty_steps=max_empty_steps,
    )
    p.cfg = SimpleNamespace(pipeline=pipe, experiment="x", algo=SimpleNamespace(off_policy_correction=None))
    p.out, p.start_step = tmp_path, 1
    p._created, p.wall_before = time.perf_counter(), 0.0
    p.tracker = Tracker(tmp_path, trackers=())
    p.tracker.plot = lambda keys, force=False: None  # type: ignore[method-assign]  # (no curves.png: seconds)
    p.collector, p.trainer = collector, _Trainer()
    p.cluster = SimpleNamespace(fault_metrics=dict)
    p.empty_steps = EmptySteps(max_empty_steps)
    p.healthy_checkpoint = None
    p.saved = []  # type: ignore[attr-defined]
    p.checkpoint = lambda step: p.saved.append(step)  # type: ignore[method-assign,attr-defined,func-returns-value]
    p.reports = []  # type: ignore[attr-defined]
    p.report = lambda status, wall: p.reports.append(status)  # type: ignore[method-assign,attr-defined]
    return p


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_run_that_trains_nothing_stops_after_max_empty_steps_naming_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """pipeline=agent with an engine failing every request: every step empty. The run ran all 10 steps and
    returned a summary as if it had trained (exit 0); now it stops at step 3 with the engine's failures named."""
    p = _pipeline(tmp_path, _Collector([EMPTY] * 10, ENGINE_DOWN), max_empty_steps=3, max_steps=10)
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.empty_steps"):
        with pytest.raises(EmptyStepsError) as info:
            p.run()
    msg = str(info.value)
    assert msg.startswith("step 3: 3 steps in a row trained nothing (pipeline.max_empty_steps=3)")
    for named in ("agent/engine_errors=4, requests the inference engine failed", "data/aborted_episodes=4"):
        assert named in msg
    assert "check the inference engine's log" in msg and "pipeline.max_empty_steps=0 never stops" in msg
    # the stopping step is logged and on disk; no step trained, nothing was saved
    assert [(r["step"], r["data/empty_steps"], r["agent/engine_errors"]) for r in _records(tmp_path)] == [
        (1, 1.0, 4.0),
        (2, 1.0, 4.0),
        (3, 1.0, 4.0),
    ]
    assert p.trainer.updated == [] and p.saved == []  # type: ignore[attr-defined]
    assert p.reports == [f"failed: EmptyStepsError: {msg[:300]}"]  # type: ignore[attr-defined]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3 and warned[1].startswith(
        "step 2 trained nothing (2 in a row of pipeline.max_empty_steps=3): agent/engine_errors=4, requests"
    )


def test_a_step_that_trains_resets_the_streak_and_the_summary_counts_the_empty_steps(tmp_path: Path) -> None:
    script = [EMPTY, EMPTY, BATCH, EMPTY, EMPTY, BATCH, EMPTY]
    p = _pipeline(tmp_path, _Collector(script, {"data/dropped_groups": 8}), max_empty_steps=3, max_steps=7)
    summary = p.run()
    assert summary["empty_steps"] == 5 and summary["status"] == "finished"
    assert p.trainer.updated == [3, 6]
    assert [r["data/empty_steps"] for r in _records(tmp_path)] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_zero_never_stops(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = _pipeline(tmp_path, _Collector([EMPTY] * 6), max_empty_steps=0, max_steps=6)
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.empty_steps"):
        summary = p.run()
    assert summary["empty_steps"] == 6 and p.saved == [6]  # type: ignore[attr-defined]
    assert len(caplog.records) == 6
    assert caplog.records[-1].getMessage() == (
        "step 6 trained nothing (6 in a row): no reason in the step's metrics (the collector returned no batch)"
    )


def test_a_by_design_none_is_not_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A warm-up's None neither counts nor ends a streak: 4 warm-up steps and a limit of 2 do not stop the run;
    the empty steps around a warm-up one add up (steps 6, 7, 8 with 7 a warm-up: the stop is at 8)."""
    script = [WARMUP] * 4 + [BATCH, EMPTY, WARMUP, EMPTY, BATCH]
    p = _pipeline(tmp_path, _Collector(script), max_empty_steps=2, max_steps=9)
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.empty_steps"):
        with pytest.raises(EmptyStepsError, match=r"^step 8: 2 steps in a row trained nothing"):
            p.run()
    assert [r["data/empty_steps"] for r in _records(tmp_path)] == [0.0] * 5 + [1.0, 0.0, 1.0]
    assert [r.getMessage()[:7] for r in caplog.records] == ["step 6 ", "step 8 "]


def test_a_collector_that_never_trains_by_design_runs_to_the_end(tmp_path: Path) -> None:
    """pipeline=rollout: `next` is None every step, by design (the collector's class attribute)."""
    from roll_core.pipelines.collectors.rollout_only import RolloutCollector

    class _Rollout(_Collector):
        def __init__(self) -> None:
            super().__init__([])
            del self.empty_by_design  # the class's, as RolloutCollector has it

        empty_by_design = True

        def next(self, step: int, out: Any) -> None:
            out["rollout/step_rows"] = 8.0
            return None

    assert RolloutCollector.empty_by_design is True
    p = _pipeline(tmp_path, _Rollout(), max_empty_steps=1, max_steps=4)
    assert p.run()["empty_steps"] == 0
    assert [r["data/empty_steps"] for r in _records(tmp_path)] == [0.0] * 4


def test_an_rlvr_run_whose_every_group_is_filtered_stops(tmp_path: Path) -> None:
    """The real loop on the tiny model: no response can say the answer, every group scores 0, and dynamic sampling
    (algo.drop_uniform_groups) filters every group out. The run trained nothing for 5 steps and finished."""
    from roll_core.testing import run_pipeline, tiny_overrides

    data = tmp_path / "unanswerable.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}: say 7", "answer": "918273645"}) + "\n" for i in range(64)))
    extra = ("algo.drop_uniform_groups=true", "algo.refill_max_batches=1", "pipeline.max_empty_steps=2")
    overrides = tiny_overrides(data, tmp_path / "out", *extra, "pipeline.max_steps=5", "pipeline.trackers=[]")
    with pytest.raises(EmptyStepsError, match=r"^step 2: 2 steps in a row trained nothing") as info:
        run_pipeline(overrides)
    assert "data/dropped_groups=4, prompt groups filtered out by algo.drop_uniform_groups" in str(info.value)
    assert "set algo.drop_uniform_groups=false" in str(info.value)
    records = _records(tmp_path / "out")
    assert [(r["step"], r["data/empty_steps"]) for r in records] == [(1, 1.0), (2, 1.0)]
    assert "failed: EmptyStepsError: step 2: 2 steps in a row" in (tmp_path / "out" / "report.md").read_text()


def test_a_resumed_run_continues_the_streak_of_its_records() -> None:
    guard = EmptySteps(3)
    guard.resume(
        [{"step": 0}, {"step": 1, "data/empty_steps": 1.0}, {"step": 2, "data/empty_steps": 0.0}]
        + [{"step": s, "data/empty_steps": 1.0} for s in (3, 4)]
    )
    assert guard.streak == 2 and not guard.exceeded
    guard.count(5, {}, trained=False)
    assert guard.exceeded


def test_the_key_defaults_to_5_and_must_be_at_least_0() -> None:
    assert load_config([]).pipeline.max_empty_steps == 5
    assert load_config(["pipeline.max_empty_steps=0"]).pipeline.max_empty_steps == 0
    with pytest.raises(ConfigError, match=r"pipeline[.]max_empty_steps=-1 must be >= 0"):
        load_config(["pipeline.max_empty_steps=-1"])
