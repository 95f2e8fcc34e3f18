"""What the trackers do at the edges of what their backends take (roll_core.tracking, roll_core.trackers): values a
float cannot hold, metric names a backend refuses or reserves, and a resumed MLflow run whose record lags what the
server holds. Each backend runs locally: MLflow on the run folder's SQLite store, W&B offline, SwanLab in local mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_core.testing.mlflow_server import clear_mlflow_env, run_id_of
from roll_core.tracking import Tracker

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # (SQLAlchemy's, reading MLflow's sqlite store here)
]


def _points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every point of every metric of the MLflow run the run folder records, (step, value) in step order."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    run_id = run_id_of(run_dir)
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((p.step, p.value) for p in client.get_metric_history(run_id, k)) for k in keys}


def test_a_resume_whose_run_json_lags_the_server_logs_no_step_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server took steps 3 and 4, and the process died before run.json said so (a kill mid-send; a slow
    server's answer never read). The resume from the checkpoint at step 3 continued that run: step 3 was sent again
    from metrics.jsonl (two points) and the abandoned step 4 stayed beside the redone one. A new run replays the run
    folder's steps instead: one point per step, the values of metrics.jsonl."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from roll_core.trackers.mlflow import MlflowTracker

    clear_mlflow_env(monkeypatch)
    cfg = "experiment: lag\n"
    tracker = Tracker(tmp_path, cfg, ["mlflow"])
    for step in range(3):
        tracker.log(step, {"loss": float(step)})
    tracker.backends[0].wait()
    first_run = run_id_of(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(MlflowTracker, "_save_state", lambda self: None)  # run.json is never told of steps 3 and 4
        for step in (3, 4):
            tracker.log(step, {"loss": float(step)})
        tracker.backends[0].wait()
    assert json.loads((tmp_path / "mlflow" / "run.json").read_text())["last_step"] == 2
    # the process dies here (no close: its worker just stops); the run resumes from its checkpoint at step 3
    dead = tracker.backends[0]
    dead._worker.finish(lambda: None)
    dead._worker = None
    resumed = Tracker(tmp_path, cfg, ["mlflow"], resume=True)
    resumed.truncate(3)
    for step in (4, 5):
        resumed.log(step, {"loss": 10.0 + step})
    resumed.close()
    assert _points(tmp_path) == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)]}
    assert run_id_of(tmp_path) != first_run
    assert [(h["step"], h["loss"]) for h in Tracker.read_metrics(tmp_path / "metrics.jsonl")] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)
    ]  # fmt: skip


class _Recorder:
    """A backend added by hand: what it is given."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, dict(metrics)))

    def truncate(self, last_step: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_an_int_past_a_floats_range_is_null_once_warned_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`math.isfinite` of an int past a double's range raised OverflowError into the training loop (a step's
    metrics lost, the run ended). It is null in metrics.jsonl, as inf is, left out of what backends get, and warned
    about once per metric; an int a float holds stays the exact int; a sample row keeps its int whole (JSON holds
    it)."""
    tracker = Tracker(tmp_path, trackers=[])
    recorder = _Recorder()
    tracker.backends.append(recorder)  # type: ignore[arg-type]
    for step in (1, 2):
        tracker.log(step, {"huge": 10**400, "negative": -(10**400), "count": 2**64, "loss": 0.5})
    tracker.samples(2, [{"prompt": "p", "answer": 10**400}])
    tracker.close()
    want = {"huge": None, "negative": None, "count": 2**64, "loss": 0.5}
    assert Tracker.read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, **want}, {"step": 2, **want}]
    assert tracker.history == [{"step": 1, **want}, {"step": 2, **want}]
    assert recorder.logged == [(s, {"count": 2**64, "loss": 0.5}) for s in (1, 2)]
    warned = [r.getMessage() for r in caplog.records if "past a float's range" in r.getMessage()]
    assert len(warned) == 2 and "'huge'" in warned[0] and "'negative'" in warned[1]
    row = json.loads((tmp_path / "samples.jsonl").read_text())
    assert row == {"step": 2, "prompt": "p", "answer": 10**400}
