"""MLflow stores on this machine's disk that cannot be written (a read-only folder or database, a full disk, a file
where a folder should be): not an outage of a server (roll_core.trackers.mlflow_http.local_failure). Said once as an
error, training goes on, and a resume sends the steps MLflow lacks. The same for the run folder's own record of its
MLflow run (run.json, unsent.json: one that cannot be written, or read back on resume). Outages of a real server:
test_tracking_mlflow_outage.py.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from roll_core.testing.mlflow_server import clear_mlflow_env, free_port, run_id_of
from roll_core.tracking import Tracker

CONFIG = "experiment: local-errors\n"
# The base run of the run.json tests: a refused send fails at once (no retries, no wait before the next try).
RECORD_CONFIG = "experiment: record\ntracking: {mlflow: {retries: 0, timeout_s: 2, retry_interval_s: 0}}\n"
LOGGER = "roll_core.trackers.mlflow"


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from roll_core.trackers.mlflow_end import stop_deliveries

    clear_mlflow_env(monkeypatch)
    yield
    stop_deliveries()  # a run's end still retried in the background (nothing answers there) outlives no test


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder whose local store holds one FINISHED MLflow run with steps 1-3 (loss = step), run.json naming it:
    each test works on its own copy (`_copy`)."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    run = tmp_path_factory.mktemp("mlflow-record") / "run"
    with pytest.MonkeyPatch.context() as mp:
        clear_mlflow_env(mp)
        tracker = Tracker(run, RECORD_CONFIG, ["mlflow"])
        for step in (1, 2, 3):
            tracker.log(step, {"loss": float(step)})
        tracker.close(failed=False)
    return run


def _copy(recorded: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"  # a moved folder resumes its own local store (test_tracking_mlflow_moved.py)
    shutil.copytree(recorded, run)
    return run


def _client(run: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow' / 'mlflow.db'}")


def _ours(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


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


def _resume_and_log(run: Path, caplog: pytest.LogCaptureFixture, step: int) -> None:
    """Resume `run`'s tracker (mlflow, RECORD_CONFIG) at `step` - 1 and log `step` (loss `step`), roll's warnings
    captured; closed once its backend is done (nothing raises into training)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    resumed = Tracker(run, RECORD_CONFIG, ["mlflow"], resume=True)
    resumed.truncate(step - 1)
    resumed.log(step, {"loss": float(step)})
    resumed.backends[0].wait()  # nothing raises into training
    resumed.close(failed=False)


def _recorded_state(run: Path) -> dict[str, Any]:
    return dict(json.loads((run / "mlflow" / "run.json").read_text()))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "damage",
    ["cut", "no last_step", "no run_id", "null last_step", "not an object"],
)
def test_a_resume_whose_run_json_cannot_be_used_starts_a_new_run_with_the_folders_steps(
    recorded: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """run.json cut by a crash (an attempt that wrote it in place), or without its `run_id` / `last_step`: the resume
    raised a ValueError / KeyError / TypeError / AttributeError into training (the first call after `truncate`).
    Now it is warned about once, naming the file, and taken for no record: a new MLflow run is sent the folder's
    steps 1-3 from metrics.jsonl, then step 4."""
    run = _copy(recorded, tmp_path)
    state = _recorded_state(run)
    text = json.dumps(state)
    damaged = {
        "cut": text[: len(text) // 2],
        "no last_step": json.dumps({k: v for k, v in state.items() if k != "last_step"}),
        "no run_id": json.dumps({k: v for k, v in state.items() if k != "run_id"}),
        "null last_step": json.dumps({**state, "last_step": None}),
        "not an object": json.dumps([state]),
    }[damage]
    (run / "mlflow" / "run.json").write_text(damaged)

    _resume_and_log(run, caplog, 4)
    from roll_core.trackers.mlflow import read_run

    warned = _ours(caplog, logging.WARNING)
    assert len(warned) == 1 and f"{run / 'mlflow' / 'run.json'} cannot be used (" in warned[0], warned
    assert not _ours(caplog, logging.ERROR)
    new = _recorded_state(run)
    assert new["run_id"] != state["run_id"] and new["last_step"] == 4
    assert read_run(_client(run), new["run_id"]) == {s: {"loss": float(s)} for s in (1, 2, 3, 4)}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("first", ["log", "samples"])
def test_a_run_json_that_cannot_be_written_is_said_once_and_a_resume_sends_the_rest(
    recorded: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, first: str
) -> None:
    """run.json cannot be written (here a folder where its temporary file goes: a full disk or a read-only `mlflow`
    folder fail the same way): the OSError of `_save_state` raised into training from `log` / `samples` (it ran
    before the send, outside the local-failure path). Now it is said once as an error naming run.json, MLflow gets
    nothing more from the attempt, and a resume once it can be written sends steps 4-5 to the same run."""
    run = _copy(recorded, tmp_path)
    recorded_id = run_id_of(run)
    tracker = Tracker(run, RECORD_CONFIG, ["mlflow"], resume=True)
    tracker.truncate(3)  # the recorded run goes on
    backend = tracker.backends[0]
    backend.wait()
    blocker = run / "mlflow" / "run.json.tmp"
    blocker.mkdir()

    caplog.set_level(logging.WARNING, logger=LOGGER)
    if first == "samples":
        tracker.samples(4, [{"prompt": "p", "response": "r"}])
    tracker.log(4, {"loss": 4.0})
    tracker.log(5, {"loss": 5.0})
    backend.wait()  # nothing raises into training
    tracker.close(failed=False)
    from roll_core.trackers.mlflow import read_run

    said = [r for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in said] == [logging.ERROR], [r.getMessage() for r in said]
    assert f"{run / 'mlflow' / 'run.json'} cannot be written (IsADirectoryError: " in said[0].getMessage()
    assert "lacks the steps after 3" in said[0].getMessage() and backend.failures == 0
    client = _client(run)
    assert read_run(client, recorded_id) == {s: {"loss": float(s)} for s in (1, 2, 3)}
    assert client.get_run(recorded_id).info.status == "FINISHED"
    assert _recorded_state(run)["last_step"] == 3

    blocker.rmdir()  # run.json can be written again: the resume sends what MLflow lacks, to the same run
    resumed = Tracker(run, RECORD_CONFIG, ["mlflow"], resume=True)
    resumed.truncate(5)
    resumed.close(failed=False)
    assert run_id_of(run) == recorded_id
    assert read_run(client, recorded_id) == {s: {"loss": float(s)} for s in (1, 2, 3, 4, 5)}
    tables = [a.path for a in client.list_artifacts(recorded_id, "samples")]
    assert tables == (["samples/step_000004.json"] if first == "samples" else [])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_an_unsent_json_that_cannot_be_written_is_said_once_and_a_resume_sends_the_rest(
    recorded: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`close()` with the server away keeps the buffer in unsent.json; that file cannot be written (a full disk): the
    OSError raised from `close()`. Now it is said once as an error naming unsent.json, run.json still names only
    what the server holds (step 3), and a resume sends step 4 from metrics.jsonl to the same run."""
    from mlflow.tracking import MlflowClient

    run = _copy(recorded, tmp_path)
    recorded_id = run_id_of(run)
    tracker = Tracker(run, RECORD_CONFIG, ["mlflow"], resume=True)
    tracker.truncate(3)
    backend = tracker.backends[0]
    backend.wait()
    backend.client = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")  # nothing answers there
    blocker = run / "mlflow" / "unsent.json.tmp"
    blocker.mkdir()

    caplog.set_level(logging.WARNING, logger=LOGGER)
    tracker.log(4, {"loss": 4.0})
    tracker.close(failed=False)  # raises nothing
    from roll_core.trackers.mlflow import read_run

    errors = _ours(caplog, logging.ERROR)
    assert len(errors) == 1 and f"{run / 'mlflow' / 'unsent.json'} cannot be written (IsADirectoryError: " in errors[0]
    assert "lacks the steps after 3" in errors[0], errors
    assert _recorded_state(run)["last_step"] == 3 and not (run / "mlflow" / "unsent.json").exists()
    assert json.loads((run / "mlflow" / "end.json").read_text())["run_id"] == recorded_id  # its end: told later

    blocker.rmdir()
    resumed = Tracker(run, RECORD_CONFIG, ["mlflow"], resume=True)
    resumed.truncate(4)
    resumed.close(failed=False)
    client = _client(run)
    assert run_id_of(run) == recorded_id and client.get_run(recorded_id).info.status == "FINISHED"
    assert read_run(client, recorded_id) == {s: {"loss": float(s)} for s in (1, 2, 3, 4)}


@pytest.fixture(scope="module")
def unsent(recorded: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`recorded` resumed at step 3, steps 4-5 logged (with a sample table at 4) while the server is away: closed,
    they are in unsent.json and run.json counts them (last step 5). Each test works on its own copy (`_copy`)."""
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow_end import stop_deliveries

    run = _copy(recorded, tmp_path_factory.mktemp("mlflow-unsent"))
    with pytest.MonkeyPatch.context() as mp:
        clear_mlflow_env(mp)
        tracker = Tracker(run, RECORD_CONFIG, ["mlflow"], resume=True)
        tracker.truncate(3)
        tracker.backends[0].wait()
        tracker.backends[0].client = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")  # nobody there
        tracker.samples(4, [{"prompt": "p", "response": "r"}])
        tracker.log(4, {"loss": 4.0})
        tracker.log(5, {"loss": 5.0})
        tracker.close(failed=False)
        stop_deliveries()
    kept = json.loads((run / "mlflow" / "unsent.json").read_text())
    assert sorted({m[3] for m in kept["metrics"]}) == [4, 5] and _recorded_state(run)["last_step"] == 5
    return run


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("damage", ["cut", "no metrics", "a point cut short"])
def test_a_resume_whose_unsent_json_cannot_be_used_replaces_the_run_with_the_folders_steps(
    unsent: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """unsent.json cut by a crash while `close()` wrote it, or a part of it missing / of another shape: the resume
    raised a JSONDecodeError / KeyError into training (or a send failed on the point). Ignored, steps 4-5 (counted
    as held by run.json) and the step-4 table were lost. Now it is warned about once, naming the file, and the run is
    not continued: a new MLflow run holds steps 1-6 once each and the table, the recorded one is superseded."""
    run = _copy(unsent, tmp_path)
    recorded_id = run_id_of(run)
    path = run / "mlflow" / "unsent.json"
    kept = json.loads(path.read_text())
    text = json.dumps(kept)
    damaged = {
        "cut": text[: len(text) // 2],
        "no metrics": json.dumps({k: v for k, v in kept.items() if k != "metrics"}),
        "a point cut short": json.dumps({**kept, "metrics": [m[:3] for m in kept["metrics"]]}),
    }[damage]
    path.write_text(damaged)

    _resume_and_log(run, caplog, 6)
    from roll_core.trackers.mlflow import read_run

    warned = _ours(caplog, logging.WARNING)
    assert len(warned) == 1 and f"{path} cannot be used (" in warned[0], warned
    assert not _ours(caplog, logging.ERROR)
    client, new = _client(run), _recorded_state(run)
    assert new["run_id"] != recorded_id and new["last_step"] == 6
    assert read_run(client, new["run_id"]) == {s: {"loss": float(s)} for s in range(1, 7)}
    assert sorted(p.step for p in client.get_metric_history(new["run_id"], "loss")) == list(range(1, 7))  # once each
    assert [a.path for a in client.list_artifacts(new["run_id"], "samples")] == ["samples/step_000004.json"]
    assert client.get_run(recorded_id).info.lifecycle_stage == "deleted"
    assert not path.exists() and not (run / "mlflow" / "end.json").exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_run_created_but_not_usable_is_not_left_running(
    recorded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`_start` created the MLflow run, then could not give it its artifacts folder (`own_artifacts`) or name it in
    run.json: the run stayed RUNNING for good beside the one a later start made. Now it is ended (KILLED, moved to
    MLflow's deleted runs) before the failure goes its way: raised at the start of a new run, said once on a
    resume (training goes on)."""
    from mlflow.entities import ViewType

    import roll_core.trackers.mlflow as backend_module

    run = _copy(recorded, tmp_path)
    recorded_id, client = run_id_of(run), _client(run)
    experiment = client.get_run(recorded_id).info.experiment_id

    def others() -> list[Any]:
        runs = client.search_runs([experiment], run_view_type=ViewType.ALL)
        return [r.info for r in runs if r.info.run_id != recorded_id]

    def refused(*_: object) -> str:
        raise PermissionError(errno.EACCES, "Permission denied", str(run / "mlflow" / "artifacts"))

    with monkeypatch.context() as patch:
        patch.setattr(backend_module, "own_artifacts", refused)
        with pytest.raises(RuntimeError, match="cannot start the run"):
            Tracker(run, RECORD_CONFIG, ["mlflow"])  # a new run: the store must take it before training
    assert [(r.status, r.lifecycle_stage) for r in others()] == [("KILLED", "deleted")]

    # a resume that starts a new run (no usable record) where run.json cannot be written
    (run / "mlflow" / "run.json").unlink()
    (run / "mlflow" / "run.json.tmp").mkdir()
    _resume_and_log(run, caplog, 4)
    errors = _ours(caplog, logging.ERROR)
    assert len(errors) == 1 and f"{run / 'mlflow' / 'run.json'} cannot be written (IsADirectoryError" in errors[0]
    assert [(r.status, r.lifecycle_stage) for r in others()] == [("KILLED", "deleted")] * 2
