"""A tracker backend that was away while a resumed run redid steps (run 1 with it, run 2 without it resuming from an
earlier checkpoint, run 3 with it again): its store still held run 1's values of the redone steps and its record said
so, so run 3 kept them (TensorBoard purged only after run 3's checkpoint; W&B and MLflow continued their run) and
the curve showed the abandoned values where metrics.jsonl holds the redone ones. `trackers.json` makes such a
backend drop them and receive the run folder's values, as the core files do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from roll_core import registry
from roll_core.tracking import Tracker

#: (trackers, steps logged, checkpoint resumed from, value offset): run 2 redoes steps 3-5 without the backend.
ATTEMPTS = ((True, range(0, 6), None, 0.0), (False, range(3, 8), 2, 0.25), (True, range(7, 9), 6, 0.5))
EXPECTED = {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.25, 4: 4.25, 5: 5.25, 6: 6.25, 7: 7.5, 8: 8.5}


def _attempts(run_dir: Path, name: str, cfg: str = "experiment: away\n", attempts: Any = ATTEMPTS) -> dict[int, float]:
    """Run the attempts (the backend `name` in those marked present); returns metrics.jsonl's loss per step."""
    for present, steps, checkpoint, offset in attempts:
        tracker = Tracker(run_dir, cfg, [name] if present else [], resume=bool(steps.start))
        if checkpoint is not None:
            tracker.truncate(checkpoint)
        for step in steps:
            tracker.log(step, {"loss": step + offset})
            tracker.samples(step, [{"response": f"r{step + offset}"}])
        tracker.close()
    return {r["step"]: r["loss"] for r in Tracker.read_metrics(run_dir / "metrics.jsonl")}


class _Recorder:
    """A plugin backend keeping what it holds as a store that cannot go back would (a truncate drops later steps)."""

    store: ClassVar[dict[int, float]] = {}
    rows: ClassVar[dict[int, list[dict[str, Any]]]] = {}
    calls: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, *, run_dir: Path, config: dict[str, Any], name: str, resume: bool) -> None:
        if not resume:
            type(self).store, type(self).rows = {}, {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        assert step not in self.store, f"step {step} logged twice"
        assert not self.store or step > max(self.store), f"step {step} goes back"
        self.calls.append(("log", step))
        self.store[step] = metrics["loss"]

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.rows[step] = rows

    def truncate(self, last_step: int) -> None:
        self.calls.append(("truncate", last_step))
        for step in [s for s in self.store if s > last_step]:
            del self.store[step]
            self.rows.pop(step, None)

    def close(self) -> None:
        pass


def test_a_plugin_away_while_steps_were_redone_drops_them_and_gets_the_redone_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "load", lambda group, name: _Recorder)
    _Recorder.calls = []
    assert _attempts(tmp_path, "recorder") == EXPECTED
    assert _Recorder.store == EXPECTED
    assert {s: rows[0]["response"] for s, rows in _Recorder.rows.items()} == {s: f"r{v}" for s, v in EXPECTED.items()}
    # run 3: truncated to run 2's checkpoint (2), then sent 3-6 from the run folder, then its own steps
    assert _Recorder.calls[6:] == [("truncate", 2), *(("log", s) for s in range(3, 9))]
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"stale_after": {"recorder": None}}


def test_a_fresh_run_without_the_backend_makes_all_it_held_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 2 started afresh (no checkpoint) without the backend, and run 3 resumed from run 2's checkpoint: nothing
    of run 1 is valid any more."""
    monkeypatch.setattr(registry, "load", lambda group, name: _Recorder)
    _Recorder.calls = []
    attempts = ((True, range(0, 6), None, 0.0), (False, range(0, 4), None, 0.5), (True, range(3, 5), 2, 0.25))
    for present, steps, checkpoint, offset in attempts:
        tracker = Tracker(
            tmp_path, "experiment: away\n", ["recorder"] if present else [], resume=checkpoint is not None
        )
        if checkpoint is not None:
            tracker.truncate(checkpoint)
        for step in steps:
            tracker.log(step, {"loss": step + offset})
        tracker.close()
    assert _Recorder.store == {0: 0.5, 1: 1.5, 2: 2.5, 3: 3.25, 4: 4.25}


def test_a_backend_away_while_nothing_was_redone_is_sent_the_steps_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 2 without the backend resumed at run 1's last step (a preemption) and redid nothing: run 3 truncates the
    backend at that step (nothing of it is dropped) and sends it the steps 3-6 it lacks from the run folder, even a
    plugin that does not replay them itself. `jsonl` (no store of its own) is not recorded."""
    monkeypatch.setattr(registry, "load", lambda group, name: _Recorder)
    _Recorder.calls = []
    _attempts(
        tmp_path,
        "recorder",
        attempts=((True, range(0, 3), None, 0.0), (False, range(3, 7), 2, 0.0), (True, range(7, 9), 6, 0.0)),
    )
    assert _Recorder.store == {s: float(s) for s in range(9)}
    assert _Recorder.calls[3:] == [("truncate", 2), *(("log", s) for s in range(3, 9))]
    monkeypatch.undo()
    Tracker(tmp_path / "jsonl", None, ["jsonl"]).close()
    assert not (tmp_path / "jsonl" / "trackers.json").exists()


def test_tensorboard_away_while_steps_were_redone_shows_the_redone_values(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the roll-core[track] extra")
    from test_tracking import _scalars

    assert _attempts(tmp_path, "tensorboard") == EXPECTED
    assert _scalars(tmp_path / "tensorboard") == {"loss": sorted(EXPECTED.items())}


def test_wandb_away_while_steps_were_redone_starts_a_run_with_the_redone_values(tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="the roll-core[wandb] extra")
    from test_tracking_wandb import _current

    cfg = yaml.safe_dump({"experiment": "away", "tracking": {"wandb": {"mode": "offline", "project": "away"}}})
    assert _attempts(tmp_path, "wandb", cfg) == EXPECTED
    shown: dict[int, float] = {}
    for run in _current(tmp_path):
        shown.update({s: m["loss"] for s, m in run["history"].items() if "loss" in m})
    assert shown == EXPECTED


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # MLflow's SQL store (as test_tracking_mlflow_store.py)
def test_mlflow_away_while_steps_were_redone_starts_a_run_with_the_redone_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run folder's own SQLite store (no server)."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.testing.mlflow_server import clear_mlflow_env, run_id_of
    from roll_core.trackers.mlflow import read_run

    clear_mlflow_env(monkeypatch)
    assert _attempts(tmp_path, "mlflow") == EXPECTED
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    assert {s: m["loss"] for s, m in read_run(client, run_id_of(tmp_path)).items()} == EXPECTED


def test_swanlab_away_while_steps_were_redone_shows_the_redone_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SwanLab starts a new experiment on every resume (it replays the run folder's steps): right before and after."""
    pytest.importorskip("swanlab", reason="the roll-core[swanlab] extra")
    from test_tracking_swanlab import _current

    for var in ("SWANLAB_API_KEY", "SWANLAB_MODE", "SWANLAB_LOG_DIR", "SWANLAB_PROJ_NAME", "SWANLAB_EXP_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-home"))
    options = {"project": "away", "hardware_monitor": False}
    cfg = yaml.safe_dump({"experiment": "away", "tracking": {"swanlab": options}})
    assert _attempts(tmp_path / "run", "swanlab", cfg) == EXPECTED
    assert {s: m["loss"] for s, m in _current(tmp_path / "run")["history"].items()} == EXPECTED
