"""MLflow stores on this machine's disk that cannot be written (a read-only folder or database, a full disk, a file
where a folder should be): not an outage of a server (roll_core.trackers.mlflow_http.local_failure). Said once as an
error, training goes on, and a resume sends the steps MLflow lacks. Outages of a real server:
test_tracking_mlflow_outage.py.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import sqlite3
from pathlib import Path
from urllib.parse import urlparse

import pytest

from roll_core.testing.mlflow_server import clear_mlflow_env, run_id_of
from roll_core.tracking import Tracker

CONFIG = "experiment: local-errors\n"


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_mlflow_env(monkeypatch)


def _raised(call: object) -> BaseException:
    try:
        call()  # type: ignore[operator]
    except BaseException as exc:
        return exc
    raise AssertionError(f"{call} raised nothing")


def test_errors_of_the_local_disk_are_not_network_errors(tmp_path: Path) -> None:
    """Anything without a permanent MLflow error code counted as a network error: a PermissionError / ENOSPC of the
    artifacts folder was resent for the whole run (a read-only SQLite store: the next test). A connection's errors
    (refused, unreachable, a busy SQLite database) still are network errors."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow_http import bounded_http, is_network_error

    assert not is_network_error(PermissionError(errno.EACCES, "Permission denied", str(tmp_path)))
    assert not is_network_error(OSError(errno.ENOSPC, "No space left on device"))

    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
    with bounded_http(1, 0):
        unreachable = _raised(lambda: client.get_experiment_by_name("e"))
    assert isinstance(unreachable, MlflowException) and is_network_error(unreachable)
    assert is_network_error(OSError(errno.ENETUNREACH, "Network is unreachable"))
    db = tmp_path / "x.db"
    sqlite3.connect(db).execute("CREATE TABLE experiments (id)").connection.commit()
    holder = sqlite3.connect(db, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")  # another writer: SQLITE_BUSY, worth trying again
    try:
        busy = _raised(lambda: sqlite3.connect(db, timeout=0).execute("SELECT 1 FROM experiments"))
    finally:
        holder.rollback()
        holder.close()
    assert is_network_error(busy)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_local_store_that_cannot_be_written_is_said_once_and_a_resume_sends_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The run folder's artifacts could not be written (here a file where the `samples` folder goes: a read-only
    folder or a full disk fail the same way): the error was taken for an outage, "MLflow at sqlite:///... is not
    answering", counted as failed sends, resent for the whole run and written to unsent.json. Now one error names
    it, nothing raises into training, MLflow gets nothing more from the attempt, and a resume once the folder can be
    written sends the steps it lacks to the same run."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import read_run
    from roll_core.trackers.mlflow_http import is_network_error

    run = tmp_path / "run"
    tracker = Tracker(run, CONFIG, ["mlflow"])
    backend = tracker.backends[0]
    tracker.log(1, {"loss": 1.0})
    backend.wait()
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow' / 'mlflow.db'}")
    run_id = run_id_of(run)
    blocker = Path(urlparse(client.get_run(run_id).info.artifact_uri).path) / "samples"
    blocker.write_text("")

    caplog.set_level(logging.WARNING, logger="roll_core.trackers.mlflow")
    tracker.samples(2, [{"prompt": "p", "response": "r"}])
    tracker.log(2, {"loss": 2.0})
    tracker.log(3, {"loss": 3.0})
    backend.wait()  # nothing raises into training
    tracker.close(failed=False)
    said = [r for r in caplog.records if r.name == "roll_core.trackers.mlflow"]
    assert [r.levelno for r in said] == [logging.ERROR], [r.getMessage() for r in said]
    assert "cannot be written (NotADirectoryError: " in said[0].getMessage()
    assert "not answering" not in caplog.text and backend.failures == 0
    assert read_run(client, run_id) == {1: {"loss": 1.0}}
    assert client.get_run(run_id).info.status == "FINISHED"
    assert json.loads((run / "mlflow" / "run.json").read_text())["last_step"] == 1  # what the store took
    assert not (run / "mlflow" / "unsent.json").exists() and not (run / "mlflow" / "end.json").exists()
    # the store's database read-only: MLflow raises it as TEMPORARILY_UNAVAILABLE, not a network failure either
    read_only = MlflowClient(tracking_uri=f"sqlite:///file:{run / 'mlflow' / 'mlflow.db'}?mode=ro&uri=true")
    refused = _raised(lambda: read_only.create_experiment("f"))
    assert "readonly" in str(refused) and not is_network_error(refused)

    blocker.unlink()  # the folder can be written again: a resume sends what MLflow lacks, to the same run
    resumed = Tracker(run, CONFIG, ["mlflow"], resume=True)
    resumed.truncate(3)
    resumed.close(failed=False)
    assert run_id_of(run) == run_id
    assert read_run(client, run_id) == {s: {"loss": float(s)} for s in (1, 2, 3)}
    assert "samples/step_000002.json" in [a.path for a in client.list_artifacts(run_id, "samples")]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_redo_whose_new_run_cannot_be_created_in_a_read_only_store_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart in the process redoes steps 2-3 of an open MLflow run: `truncate(1)` starts the run that replaces it,
    in a store that cannot be written now (read-only). The error raised into training (the next call) though a local
    store's errors are said once elsewhere. Now it is said once and training goes on; run.json names the recorded run
    as valid up to step 1 only, so a resume past the redone steps replaces it (continued, it showed the abandoned
    values 2.0 and 3.0 of steps metrics.jsonl holds as 20.0 and 30.0)."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import read_run

    run = tmp_path / "run"
    tracker = Tracker(run, CONFIG, ["mlflow"])
    backend = tracker.backends[0]
    for step in (1, 2, 3):
        tracker.log(step, {"loss": float(step)})
    backend.wait()
    db = run / "mlflow" / "mlflow.db"
    client, recorded = MlflowClient(tracking_uri=f"sqlite:///{db}"), run_id_of(run)
    backend.client = MlflowClient(tracking_uri=f"sqlite:///file:{db}?mode=ro&uri=true")  # the store is read-only now

    caplog.set_level(logging.WARNING, logger="roll_core.trackers.mlflow")
    tracker.truncate(1)  # restarted from the checkpoint at step 1: steps 2 and 3 are redone
    for step in (2, 3, 4):
        tracker.log(step, {"loss": 10.0 * step})
    backend.wait()  # nothing raises into training
    ours = [r for r in caplog.records if r.name == "roll_core.trackers.mlflow"]
    errors = [r.getMessage() for r in ours if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot be written (OperationalError: " in errors[0], errors
    assert "lacks the steps after 1" in errors[0]
    tracker.close(failed=False)
    assert json.loads((run / "mlflow" / "run.json").read_text()) | {"local": True} == {
        "tracking_uri": f"sqlite:///{db}",
        "run_id": recorded,
        "last_step": 1,
        "local": True,
    }
    assert read_run(client, recorded) == {s: {"loss": float(s)} for s in (1, 2, 3)}  # nothing of the redo reached it

    resumed = Tracker(run, CONFIG, ["mlflow"], resume=True)  # the store can be written again; resumed at step 3
    resumed.truncate(3)
    resumed.close(failed=False)
    replaced = run_id_of(run)
    assert replaced != recorded and client.get_run(recorded).info.lifecycle_stage == "deleted"
    assert read_run(client, replaced) == {1: {"loss": 1.0}, 2: {"loss": 20.0}, 3: {"loss": 30.0}}
