"""MLflow tracking past a request that a hung server holds: against a real `mlflow server` (SQLite store, 127.0.0.1)
that is paused (SIGSTOP) and resumed, and a hung endpoint on 127.0.0.1 that accepts connections and never answers.

Covered: a request stuck in a hung server (one `close()` gave up on) holds up no other MLflow call of the process
(the next run of a sweep, another tracker; each gets its own HTTP settings: roll_core.trackers.mlflow_http); a run
whose end `close()` could not tell the server is not left RUNNING: its status and end time are recorded in
`<run>/mlflow/end.json` and reach MLflow once the server answers (a retry of this process), or the resume of the
run reopens it (the record removed, the retry stopped). The server (roll_core.testing.mlflow_server) is started
once per module and killed at the end, also on failure. Other outages: test_tracking_mlflow_outage.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from roll_core.testing.mlflow_server import HungEndpoint, MlflowServer, clear_mlflow_env, run_id_of, serve
from roll_core.tracking import Tracker

LOGGER = "roll_core.trackers.mlflow"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with serve(tmp_path_factory.mktemp("mlflow-stuck")) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from roll_core.trackers.mlflow_end import stop_deliveries

    clear_mlflow_env(monkeypatch)
    yield
    stop_deliveries()  # a run's end still retried in the background outlives no test


def _config(**mlflow: Any) -> str:
    return yaml.safe_dump({"experiment": "stuck", "tracking": {"mlflow": mlflow}})


def _status_when(client: Any, run_id: str, status: str, timeout_s: float) -> Any:
    """The run's info once its status is `status`, else (after `timeout_s`) as it is then."""
    deadline = time.monotonic() + timeout_s
    info = client.get_run(run_id).info
    while info.status != status and time.monotonic() < deadline:
        time.sleep(0.2)
        info = client.get_run(run_id).info
    return info


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_a_stuck_request_holds_up_no_other_mlflow_call_of_the_process(server: MlflowServer, tmp_path: Path) -> None:
    """Every MLflow call of the process took one lock for its whole duration (MLflow's HTTP settings were process-wide
    variables set for the call): a request stuck in a hung server, one `close()` had given up on, held the next run
    of a sweep in its constructor until the request failed (~17 s here; minutes with a user's long
    MLFLOW_HTTP_REQUEST_TIMEOUT). The next run starts, logs and ends at once, and a tracker of a hung server gives
    up after its own `timeout_s` (1 s), not the stuck request's (20 s)."""
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import read_run

    hung = HungEndpoint()
    config = _config(tracking_uri=server.url, timeout_s=20, retries=0, close_timeout_s=3)
    first = Tracker(tmp_path / "a", config, ["mlflow"])
    backend = first.backends[0]
    backend.client = MlflowClient(tracking_uri=hung.url)  # the server hangs once the run is created
    try:
        first.log(0, {"loss": 0.0})
        hung.wait_for(1)  # the send is stuck: its request times out 20 s from now
        stuck_since = time.monotonic()
        first.close()  # gives up at close_timeout_s=3: the request goes on

        began = time.monotonic()
        second = Tracker(tmp_path / "b", _config(tracking_uri=server.url), ["mlflow"])  # the sweep's next run
        second.log(0, {"loss": 1.0})
        second.close()
        next_run = time.monotonic() - began

        began = time.monotonic()
        with pytest.raises(RuntimeError, match="cannot start the run"):
            Tracker(tmp_path / "c", _config(tracking_uri=hung.url, timeout_s=1, retries=0), ["mlflow"])
        own_timeout = time.monotonic() - began
        still_stuck = time.monotonic() - stuck_since < 20  # the first run's request has not ended: it held no one
    finally:
        hung.close()
    assert still_stuck and next_run < 5, f"the next run took {next_run:.1f}s behind a stuck request"
    assert own_timeout < 4, f"a tracker with timeout_s=1 gave up after {own_timeout:.1f}s"
    client = server.client()
    run_id = run_id_of(tmp_path / "b")
    assert read_run(client, run_id) == {0: {"loss": 1.0}} and client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_a_run_close_gave_up_on_ends_in_mlflow_once_the_server_answers(
    server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`close()` gave up on a hung server (close_timeout_s) and the run stayed RUNNING in MLflow for good, nothing
    recorded. Its status and end time go to end.json and reach MLflow once the server answers (within seconds: a
    retry each `retry_interval_s`), the record then removed."""
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow_end import END_FILE

    config = _config(tracking_uri=server.url, timeout_s=10, retries=0, retry_interval_s=1, close_timeout_s=3)
    tracker = Tracker(tmp_path, config, ["mlflow"])
    tracker.log(0, {"loss": 0.0})
    backend, hung = tracker.backends[0], HungEndpoint()
    backend.wait()  # step 0 reached the server
    run_id, began, store = run_id_of(tmp_path), int(time.time() * 1000), backend.client
    backend.client = MlflowClient(tracking_uri=hung.url)
    server.pause()  # SIGSTOP: the server hangs
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            tracker.log(1, {"loss": 1.0})
            hung.wait_for(1)  # its send is stuck for timeout_s=10
            backend.client = store  # (what the server gets next goes to the paused server)
            tracker.close()  # gives up at close_timeout_s=3
        record = json.loads((tmp_path / "mlflow" / END_FILE).read_text())
    finally:
        server.resume()
        hung.close()
    assert record["run_id"] == run_id and record["status"] == "FINISHED" and record["end_time"] >= began
    errors = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]
    assert len(errors) == 1 and "close() stops waiting" in errors[0]
    assert f"run {run_id} shows RUNNING until the server takes its status FINISHED" in errors[0]
    assert str(tmp_path / "mlflow" / END_FILE) in errors[0]
    info = _status_when(server.client(), run_id, "FINISHED", timeout_s=20)
    assert info.status == "FINISHED" and info.end_time == record["end_time"]  # when close() was called
    backend.end_delivery.join(timeout=5)
    assert not backend.end_delivery.is_alive() and not (tmp_path / "mlflow" / END_FILE).exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_the_resume_of_a_run_whose_end_was_not_delivered_reopens_it(server: MlflowServer, tmp_path: Path) -> None:
    """A run closed while an exception propagates, the server hung: close()'s own tries fail (unsent.json) and
    the run stayed RUNNING, nothing recorded. end.json says FAILED; the resume (before the retry, 60 s away)
    continues the run: the record is removed, the retry stops, and the resumed run's close ends it."""
    from roll_core.trackers.mlflow import UNSENT_FILE, read_run
    from roll_core.trackers.mlflow_end import END_FILE

    config = _config(tracking_uri=server.url, timeout_s=1, retries=0, retry_interval_s=60, close_timeout_s=3)
    tracker = Tracker(tmp_path, config, ["mlflow"])
    tracker.log(0, {"loss": 0.0})
    backend = tracker.backends[0]
    backend.wait()
    run_id = run_id_of(tmp_path)
    server.pause()
    try:
        tracker.log(1, {"loss": 1.0})
        with pytest.raises(ValueError, match="the step failed"):
            try:
                raise ValueError("the step failed")
            finally:
                tracker.close()  # FAILED: closed while the error propagates
    finally:
        server.resume()
    assert json.loads((tmp_path / "mlflow" / END_FILE).read_text())["status"] == "FAILED"
    assert (tmp_path / "mlflow" / UNSENT_FILE).exists() and backend.end_delivery.is_alive()  # waits 60 s

    resumed = Tracker(tmp_path, config, ["mlflow"], resume=True)
    resumed.truncate(1)
    resumed.backends[0].wait()  # the run continues: its old end is moot
    assert not (tmp_path / "mlflow" / END_FILE).exists()
    backend.end_delivery.join(timeout=5)
    assert not backend.end_delivery.is_alive()  # stopped: the FAILED of the earlier attempt is never sent
    resumed.log(2, {"loss": 2.0})
    resumed.close()
    client = server.client()
    assert run_id_of(tmp_path) == run_id and client.get_run(run_id).info.status == "FINISHED"
    assert read_run(client, run_id) == {s: {"loss": float(s)} for s in range(3)}
