"""A run that starts over at step 0 in its folder (killed before its first checkpoint, then run again, alone or as a
resumed sweep's job): the earlier attempt's MLflow run, named by `<run>/mlflow/run.json`, is retired as a resume that
redoes steps retires its recorded run (roll_core.trackers.mlflow_resume). Read back through MLflow's own client from
the run folder's SQLite store (the rule is the same for a server). Resumes: test_tracking_mlflow.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from roll_core.testing.mlflow_server import clear_mlflow_env, run_id_of
from roll_core.tracking import Tracker

CONFIG = "experiment: restart\n"


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_mlflow_env(monkeypatch)


def _runs(run_dir: Path) -> dict[str, tuple[str, str, str | None, dict[int, float]]]:
    """{run id: (lifecycle stage, status, its `roll.superseded_by` tag, {step: loss})} of the folder's store."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    out: dict[str, Any] = {}
    for run in client.search_runs(ids, run_view_type=ViewType.ALL):
        history = {p.step: p.value for p in client.get_metric_history(run.info.run_id, "loss")}
        info = run.info
        out[info.run_id] = (info.lifecycle_stage, info.status, run.data.tags.get("roll.superseded_by"), history)
    return out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_a_run_started_over_in_its_folder_retires_the_abandoned_attempts_run(tmp_path: Path) -> None:
    """An attempt killed before its first checkpoint left its MLflow run RUNNING with steps 0-2; run again in the
    folder (nothing to resume from), the new attempt started a second run of the same name in the same experiment
    and the abandoned one stayed active beside it, its steps shown as the run's. It is superseded now, as on resume
    (KILLED, tagged, in MLflow's deleted runs); a FINISHED run of the folder is a complete earlier run: kept."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    run = tmp_path / "run"
    killed = Tracker(run, CONFIG, ["mlflow"])
    for step in (0, 1, 2):
        killed.log(step, {"loss": float(step)})
    killed.backends[0].wait()  # the steps reached the store; the process is killed here (no close)
    abandoned = run_id_of(run)

    again = Tracker(run, CONFIG, ["mlflow"])
    again.log(0, {"loss": 10.0})
    again.close(failed=False)
    new = run_id_of(run)
    assert new != abandoned
    assert _runs(run) == {
        abandoned: ("deleted", "KILLED", new, {0: 0.0, 1: 1.0, 2: 2.0}),
        new: ("active", "FINISHED", None, {0: 10.0}),
    }

    third = Tracker(run, CONFIG, ["mlflow"])  # the folder's run finished: a run started over beside it keeps it
    third.log(0, {"loss": 20.0})
    third.close(failed=False)
    runs = _runs(run)
    assert runs[new] == ("active", "FINISHED", None, {0: 10.0})
    assert runs[run_id_of(run)] == ("active", "FINISHED", None, {0: 20.0}) and len(runs) == 3
