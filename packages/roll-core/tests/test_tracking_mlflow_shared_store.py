"""One MLflow store on this machine's disk shared by several run folders (a sweep with `tracking.mlflow.tracking_uri`
a `sqlite:` or `file:` URI: every job logs to one experiment, `tracking.group`): each run's artifacts (config.yaml,
sample tables) are its own run folder's. Read back through MLflow's own client. The run folder's own store:
test_tracking_mlflow_store.py; moved folders: test_tracking_mlflow_moved.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

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
