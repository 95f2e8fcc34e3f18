"""One MLflow store on this machine's disk shared by several run folders (a sweep with `tracking.mlflow.tracking_uri`
a `sqlite:` or `file:` URI: every job logs to one experiment, `tracking.group`): each run's artifacts (config.yaml,
sample tables) are its own run folder's. Read back through MLflow's own client. The run folder's own store:
test_tracking_mlflow_store.py; moved folders: test_tracking_mlflow_moved.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import yaml

from roll_core.testing.mlflow_server import clear_mlflow_env, run_id_of
from roll_core.tracking import Tracker


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_mlflow_env(monkeypatch)


def _config(uri: str, job: int) -> str:
    return yaml.safe_dump(
        {"experiment": "scan", "job": job, "tracking": {"group": "scan-sweep", "mlflow": {"tracking_uri": uri}}}
    )


# MLflow's SQL store uses what SQLAlchemy 2.1 deprecates (the backend hides it; reading the store here does not).
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("kind", ["sqlite", "file"])
def test_each_job_of_a_shared_local_store_keeps_its_artifacts_in_its_own_folder(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experiment, created by the first job, had that job's run folder as its artifact location, and MLflow puts
    every run's artifacts under its experiment's: job 1's config.yaml and sample tables were written into job 0's
    folder (`job0/mlflow/artifacts/<job 1's run>/`), and went with it (deleted, moved, read-only). Now each job's
    run has its own folder's artifacts, and a replacement run (a resume that redoes steps) keeps them there too."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    if kind == "file":
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's file store is opt-in
        uri = (tmp_path / "store").as_uri()
    else:
        uri = f"sqlite:///{tmp_path / 'store.db'}"
    jobs = [tmp_path / "sweep" / str(job) for job in (0, 1)]
    for job, run_dir in enumerate(jobs):
        tracker = Tracker(run_dir, _config(uri, job), ["mlflow"])
        tracker.log(1, {"loss": 1.0 + job})
        tracker.samples(1, [{"prompt": f"p{job}"}])
        tracker.close(failed=False)
    # job 1 resumed from an older step: a new MLflow run replays and goes on, in job 1's folder too
    tracker = Tracker(jobs[1], _config(uri, 1), ["mlflow"], resume=True)
    tracker.truncate(0)
    tracker.log(1, {"loss": 5.0})
    tracker.samples(1, [{"prompt": "p1 again"}])
    tracker.close(failed=False)

    client = MlflowClient(tracking_uri=uri)
    runs = [run_id_of(run_dir) for run_dir in jobs]
    assert len({client.get_run(run_id).info.experiment_id for run_id in runs}) == 1  # the sweep's one experiment
    for job, (run_dir, run_id) in enumerate(zip(jobs, runs, strict=True)):
        location = Path(urlparse(client.get_run(run_id).info.artifact_uri).path)
        assert location == (run_dir / "mlflow" / "artifacts" / run_id / "artifacts").resolve(), (job, location)
        assert (location / "config.yaml").read_text() == (run_dir / "config.yaml").read_text()
        table = json.loads((location / "samples" / "step_000001.json").read_text())
        assert table["data"] == [[1, "p1 again" if job else "p0"]]
        others = run_dir.parent / str(1 - job) / "mlflow" / "artifacts"
        assert not (others / run_id).exists()  # nothing of this job in the other job's folder
    assert sorted(p.name for p in (jobs[0] / "mlflow" / "artifacts").iterdir()) == [runs[0]]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_location_the_user_chose_that_ends_like_a_run_folders_is_left_as_it_is(tmp_path: Path) -> None:
    """An experiment made by hand, its artifacts in `<team>/mlflow/artifacts` (ending as a run folder's does): its
    runs' artifacts stay there (they were moved into the roll run folder, which is no store the user chose). A
    roll-made experiment's location is still each job's own (the test above)."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    chosen = (tmp_path / "team" / "mlflow" / "artifacts").resolve()
    MlflowClient(tracking_uri=uri).create_experiment("scan-sweep", artifact_location=chosen.as_uri())
    run_dir = tmp_path / "sweep" / "0"
    tracker = Tracker(run_dir, _config(uri, 0), ["mlflow"])
    tracker.log(1, {"loss": 1.0})
    tracker.close(failed=False)

    run_id = run_id_of(run_dir)
    location = Path(urlparse(MlflowClient(tracking_uri=uri).get_run(run_id).info.artifact_uri).path)
    assert location == chosen / run_id / "artifacts"
    assert (location / "config.yaml").read_text() == (run_dir / "config.yaml").read_text()
    assert not (run_dir / "mlflow" / "artifacts").exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_job_starting_before_the_first_job_recorded_its_run_keeps_its_own_artifacts(tmp_path: Path) -> None:
    """Jobs start together: the first job's folder records no run yet (no run.json) when the second job's run is
    created; the experiment roll made is known by its tag, and the second job's artifacts are its own folder's."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    jobs = [tmp_path / "sweep job" / str(job) for job in (0, 1)]  # (a space: the location is a URI)
    for job, run_dir in enumerate(jobs):
        tracker = Tracker(run_dir, _config(uri, job), ["mlflow"])
        tracker.close(failed=False)
        if job == 0:
            (run_dir / "mlflow" / "run.json").rename(run_dir / "run.json.kept")
    run_id = run_id_of(jobs[1])
    location = Path(unquote(urlparse(MlflowClient(tracking_uri=uri).get_run(run_id).info.artifact_uri).path))
    assert location == (jobs[1] / "mlflow" / "artifacts" / run_id / "artifacts").resolve()
