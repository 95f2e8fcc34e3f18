"""What the loop guards, end to end on the tiny model: a reward that fails on every row stops the run with one
message, failures and skipped data rows reach the summary, and a setting changed on resume takes effect (or is
refused) with config.yaml recording what is in effect."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from roll_core.errors import ConfigError
from roll_core.report import _duration
from roll_core.testing import run_pipeline, tiny_overrides

sys.path.insert(0, str(Path(__file__).parent))  # bad_input_helpers: a reward that fails on chosen answers

FAULTY = "env.reward._target_=bad_input_helpers.AnswerFaultReward"


def _rows(path: Path, answers: list[str], bad_lines: int = 0) -> Path:
    rows = [json.dumps({"prompt": f"Q{i}: say 7", "answer": a}) for i, a in enumerate(answers)]
    path.write_text("\n".join(rows + ["{not json"] * bad_lines) + "\n")
    return path


def test_a_reward_failing_on_every_row_stops_the_run(tmp_path: Path) -> None:
    from roll_core.cluster.reward_guard import RewardFailureError

    data = _rows(tmp_path / "raise.jsonl", ["raise"] * 64)
    overrides = tiny_overrides(data, tmp_path / "out", FAULTY, "pipeline.max_reward_failure_steps=2")
    with pytest.raises(RewardFailureError, match=r"step 2: the reward failed on every row for 2 steps in a row") as e:
        run_pipeline([*overrides, "pipeline.max_steps=5"])
    assert "raised" in str(e.value) and "a reward bug" in str(e.value)


def test_reward_failures_and_skipped_rows_reach_the_summary(tmp_path: Path) -> None:
    data = _rows(tmp_path / "mixed.jsonl", ["7", "nan"] * 40, bad_lines=3)
    summary, history = run_pipeline(tiny_overrides(data, tmp_path / "out", FAULTY, "pipeline.max_steps=2"))
    assert summary["reward_rows"] == 2 * 4 * 8  # steps x prompts x group size
    assert 0 < summary["reward_failed_nonfinite"] == summary["reward_failed_rows"] < summary["reward_rows"]
    assert summary["reward_all_failed_steps"] == 0
    assert summary["skipped_rows"] == {str(data): 3}
    assert all(h["data/skipped_rows"] == 3 for h in history if h["step"] > 0)


def test_a_changed_lr_on_resume_takes_effect_and_a_fixed_setting_is_refused(tmp_path: Path) -> None:
    data = _rows(tmp_path / "seven.jsonl", ["7"] * 64)
    base = tiny_overrides(data, tmp_path / "out", "algo.warmup_steps=0", "algo.lr_schedule=constant")
    _, first = run_pipeline([*base, "pipeline.max_steps=2", "algo.lr=1e-3"])
    assert first[-1]["actor/lr"] == pytest.approx(1e-3)
    _, resumed = run_pipeline([*base, "pipeline.max_steps=3", "algo.lr=1e-4", "pipeline.resume=true"])
    assert [h["step"] for h in resumed if h["step"] > 0] == [1, 2, 3]
    assert resumed[-1]["actor/lr"] == pytest.approx(1e-4)  # the optimizer's rate is the new setting
    assert "lr: 0.0001" in (tmp_path / "out" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"algo\.group_size"):
        run_pipeline([*base, "pipeline.max_steps=4", "algo.group_size=4", "pipeline.resume=true"])


def test_resume_from_a_checkpoint_rolls_back_to_it_and_keeps_the_newer_ones_aside(tmp_path: Path) -> None:
    """`pipeline.resume_from=<run>/checkpoints/step_N` continues from step N (not the run's latest), and the newer
    checkpoints move to checkpoints/abandoned-<time>/: kept, but out of the resumed run's saves and restarts."""
    data = _rows(tmp_path / "seven.jsonl", ["7"] * 64)
    run = tmp_path / "out"
    base = tiny_overrides(data, run, "pipeline.save_every=2", "pipeline.keep_last=3")
    first, _ = run_pipeline([*base, "pipeline.max_steps=4"])
    step2 = run / "checkpoints" / "step_000002"
    saved_at = json.loads((step2 / "state.json").read_text())["wall_seconds"]
    # A refused rollback (a setting that cannot change) leaves the run as it was: nothing set aside
    with pytest.raises(ConfigError, match=r"algo\.group_size"):
        run_pipeline([*base, "pipeline.max_steps=3", "algo.group_size=4", f"pipeline.resume_from={step2}"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    summary, history = run_pipeline([*base, "pipeline.max_steps=3", f"pipeline.resume_from={step2}"])
    # wall time: the first process's up to step 2 (setup included), then this one's (it held this segment only)
    assert 0 < saved_at < first["wall_seconds"] and summary["wall_seconds"] > saved_at
    assert f"- wall time: {_duration(summary['wall_seconds'])}" in (run / "report.md").read_text()
    assert [h["step"] for h in history if h["step"] > 0] == [1, 2, 3]  # steps 3-4 of the first branch dropped
    assert [h["sync/weight_version"] for h in history if h["step"] > 0] == [1, 2, 3]  # the run's count, not the
    # resumed engines' (their process started at 0)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    (aside,) = (run / "checkpoints").glob("abandoned-*")
    assert [p.name for p in aside.iterdir()] == ["step_000004"] and (aside / "step_000004" / "state.json").exists()


def test_a_run_that_does_not_resume_refuses_a_folder_with_checkpoints(tmp_path: Path) -> None:
    """Without resume, a folder holding another run's checkpoints is refused (its saves would be pruned against the
    old run's, and a restart would load the old weights); resume=true with an explicit folder continues only that
    folder, never a neighbour of the same experiment."""
    data = _rows(tmp_path / "seven.jsonl", ["7"] * 64)
    old = tiny_overrides(data, tmp_path / "runs" / "old", "pipeline.max_steps=2")
    run_pipeline(old)
    with pytest.raises(ValueError, match=r"already holds the checkpoints of a run \(latest step_000002\)"):
        run_pipeline(old)
    new = tiny_overrides(data, tmp_path / "runs" / "new", "pipeline.max_steps=1", "pipeline.resume=true")
    summary, history = run_pipeline(new)
    assert summary["output_dir"] == str(tmp_path / "runs" / "new")
    assert [h["step"] for h in history if h["step"] > 0] == [1]


def test_a_run_that_fails_while_built_gives_back_its_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run failing in its build (here: a tokenizer that does not load) shuts its cluster down: Ray, placement
    groups and actors were leaked, and a sweep's next job in the process reused them and could not be placed."""
    from roll_core.cluster.launch import Cluster
    from roll_core.config import load_config
    from roll_core.pipelines.loop import Pipeline

    shut: list[bool] = []
    real = Cluster.shutdown
    monkeypatch.setattr(Cluster, "shutdown", lambda self: (shut.append(True), real(self))[1])
    data = _rows(tmp_path / "seven.jsonl", ["7"] * 8)
    cfg = load_config(tiny_overrides(data, tmp_path / "run", f"model.tokenizer={tmp_path / 'no-such-tokenizer'}"))
    with pytest.raises(OSError, match="no-such-tokenizer"):
        Pipeline(cfg)
    assert shut == [True]


def test_shutdown_closes_everything_whatever_fails() -> None:
    """After a fault, closing the collector calls dead workers and raises: the tracker and the cluster are still
    closed, and the error does not escape (it replaced the run restart already decided)."""
    from types import SimpleNamespace

    from roll_core.pipelines.loop import Pipeline

    closed: list[str] = []

    def dead() -> None:
        raise RuntimeError("actor_infer rank 0 died during abort()")

    p = Pipeline.__new__(Pipeline)
    p.collector = SimpleNamespace(close=dead)
    p.tracker = SimpleNamespace(close=lambda: closed.append("tracker"))
    p.cluster = SimpleNamespace(shutdown=lambda: closed.append("cluster"))
    p.shutdown()
    assert closed == ["tracker", "cluster"]
