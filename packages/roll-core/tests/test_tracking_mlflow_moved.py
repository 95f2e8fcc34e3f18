"""MLflow's local store (`<run>/mlflow/mlflow.db`, no tracking URI) after its run folder moved: a resume from the new
place (a sweep folder renamed or moved, then `pipeline.resume=true hydra.sweep.dir=<new place>`; a folder reached
through another mount point) continues the recorded MLflow run, or supersedes it, exactly as in place. Read back through
MLflow's own client. Resume in place: test_tracking_mlflow.py, test_tracking_mlflow_store.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from roll_core.testing.mlflow_server import clear_mlflow_env, run_id_of
from roll_core.tracking import Tracker

CONFIG = "experiment: moved\n"


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_mlflow_env(monkeypatch)


def _runs(run_dir: Path) -> dict[str, tuple[str, dict[int, float]]]:
    """{run id: (lifecycle stage, {step: loss})} of every run of the folder's local store, deleted ones too."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    out = {}
    for run in client.search_runs(ids, run_view_type=ViewType.ALL):
        history = {p.step: p.value for p in client.get_metric_history(run.info.run_id, "loss")}
        out[run.info.run_id] = (run.info.lifecycle_stage, history)
    return out


def _move(run_dir: Path, to: Path) -> Path:
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(run_dir), str(to))
    return to


# MLflow's SQL store uses what SQLAlchemy 2.1 deprecates (the backend hides it; reading the store here does not).
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_moved_run_folder_resumes_its_own_mlflow_run(tmp_path: Path) -> None:
    """run.json named the store by its path, so after a move its store read as another one: the resume started a
    second MLflow run beside the recorded one, which stayed active with the abandoned values of the redone steps
    (two runs of one roll run, steps 3 and 4 shown twice with different values), and a resume at the last logged
    step did not continue the recorded run. Now the folder's own store is the same store wherever the folder is
    (also for a run.json written before it recorded `local`)."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    first = tmp_path / "a" / "run"
    tracker = Tracker(first, CONFIG, ["mlflow"])
    for step in (1, 2, 3):
        tracker.log(step, {"loss": float(step)})
    tracker.close(failed=False)
    recorded = run_id_of(first)
    state = json.loads((first / "mlflow" / "run.json").read_text())
    state.pop("local", None)
    (first / "mlflow" / "run.json").write_text(json.dumps(state))  # as written before `local` was recorded

    # resumed at its last logged step (a preemption right after a checkpoint): the same run goes on
    second = _move(first, tmp_path / "b" / "run")
    tracker = Tracker(second, CONFIG, ["mlflow"], resume=True)
    tracker.truncate(3)
    tracker.log(4, {"loss": 4.0})
    tracker.close(failed=False)
    assert run_id_of(second) == recorded
    assert _runs(second) == {recorded: ("active", {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0})}

    # resumed from an older checkpoint (steps 3 and 4 redone): one new run replays, the recorded one is retired
    third = _move(second, tmp_path / "c" / "run")
    tracker = Tracker(third, CONFIG, ["mlflow"], resume=True)
    tracker.truncate(2)
    tracker.log(3, {"loss": 30.0})
    tracker.close(failed=False)
    replaced = run_id_of(third)
    assert replaced != recorded
    assert _runs(third) == {
        recorded: ("deleted", {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}),
        replaced: ("active", {1: 1.0, 2: 2.0, 3: 30.0}),
    }


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_moved_run_folders_artifacts_follow_it(tmp_path: Path) -> None:
    """The store's experiment kept its artifact location, an absolute path: after the folder moved, the resumed run's
    config.yaml and sample tables were written under the OLD path (the folder was made again there, `a/` beside the
    moved `b/`), and MLflow read the run's earlier artifacts from there. Now they are the moved folder's: written
    there, and every artifact of the run (the ones moved with it too) read back from there."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    first = tmp_path / "a" / "run"
    tracker = Tracker(first, CONFIG, ["mlflow"])
    tracker.log(1, {"loss": 1.0})
    tracker.samples(1, [{"prompt": "p1"}])
    tracker.close(failed=False)
    recorded = run_id_of(first)

    second = _move(first, tmp_path / "b" / "run")
    (tmp_path / "a").rmdir()
    tracker = Tracker(second, CONFIG, ["mlflow"], resume=True)
    tracker.truncate(1)
    tracker.log(2, {"loss": 2.0})
    tracker.samples(2, [{"prompt": "p2"}])
    tracker.close(failed=False)
    assert run_id_of(second) == recorded  # continued
    assert not (tmp_path / "a").exists()  # nothing written where the folder was
    client = MlflowClient(tracking_uri=f"sqlite:///{second / 'mlflow' / 'mlflow.db'}")
    assert client.get_run(recorded).info.artifact_uri == (second / "mlflow" / "artifacts").as_uri() + (
        f"/{recorded}/artifacts"
    )
    tables = sorted(a.path for a in client.list_artifacts(recorded, "samples"))
    assert tables == ["samples/step_000001.json", "samples/step_000002.json"]
    for step in (1, 2):
        table = json.loads(Path(client.download_artifacts(recorded, tables[step - 1], str(tmp_path))).read_text())
        assert table["data"] == [[step, f"p{step}"]], table
