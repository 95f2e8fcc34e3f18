"""MLflow tracking through outages: a real `mlflow server` (SQLite store, 127.0.0.1) that hangs, is killed or is
restarted on the same port, a hung endpoint that never answers, a send that fails; and the buffer's bound while the
server is away.

Covered: a log call never holds the training loop while the server is away (one request per resend, none on the
training thread); what was logged meanwhile reaches MLflow once the server answers again (with the next log, not
only at close, in step order), counted as failed sends and warned about once per outage; a hung server at close
leaves the points in `unsent.json`, sent by the resume; a resume while the server hangs goes on and opens the MLflow
run later; a resume replays the steps the continued run lacks (logged without mlflow, or buffered when the process
died); a full buffer drops its oldest points and sample tables, counted (`tracking/mlflow_dropped_points`) and warned
about once per outage, and the run folder's metrics.jsonl keeps every step; a run that ends with the server gone
ends within a bound and says what was dropped and where the rest is kept; `close()` returns within
`tracking.mlflow.close_timeout_s` whatever a hung server does, counting what it did not send. The server
(roll_core.testing.mlflow_server) is started once per module, restarted once (the last test needs it after the one
before kills it) and killed at the end, also on failure. A healthy server: test_tracking_mlflow.py.
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

from roll_core.testing.mlflow_server import (
    HungEndpoint,
    MlflowServer,
    clear_mlflow_env,
    run_id_of,
    sample_tables,
    serve,
)
from roll_core.tracking import Tracker

LOGGER = "roll_core.trackers.mlflow"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with serve(tmp_path_factory.mktemp("mlflow-outage")) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from roll_core.trackers.mlflow_end import stop_deliveries

    clear_mlflow_env(monkeypatch)
    yield
    stop_deliveries()  # a run's end still retried in the background (server gone) outlives no test


def _config(**mlflow: Any) -> str:
    return yaml.safe_dump({"experiment": "outage", "tracking": {"mlflow": mlflow}})


def _timed_logs(tracker: Tracker, steps: range) -> float:
    """Log `loss = step` at each step; the longest a log call held the caller (seconds)."""
    longest = 0.0
    for step in steps:
        began = time.monotonic()
        tracker.log(step, {"loss": float(step)})
        longest = max(longest, time.monotonic() - began)
    return longest


def _timed_close(tracker: Tracker) -> float:
    """Close `tracker`; how long close() held the caller (seconds)."""
    began = time.monotonic()
    tracker.close()
    return time.monotonic() - began


def _mlflow_records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    """(level, message) of each record the MLflow backend logged so far."""
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_a_hung_server_loses_nothing(server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from roll_core.trackers.mlflow import FAILURES_METRIC, UNSENT_FILE, read_run

    options = {"tracking_uri": server.url, "retries": 0, "retry_interval_s": 60}
    config = yaml.safe_dump({"experiment": "outage", "tracking": {"mlflow": options}})
    tracker = Tracker(tmp_path, config, ["mlflow"])
    tracker.log(0, {"loss": 1.0})
    tracker.backends[0].wait()  # (sends run off the training thread) step 0 reached the server
    run_id = run_id_of(tmp_path)
    tracker.backends[0].options.timeout_s = 1  # (tracking.mlflow.timeout_s) short for the hang, not before it
    server.pause()  # SIGSTOP: the server stops answering, requests time out
    try:
        with caplog.at_level(logging.WARNING, logger="roll_core.trackers.mlflow"):
            tracker.log(1, {"loss": 0.5})  # no exception: training goes on
            tracker.samples(1, [{"prompt": "Q", "response": "7", "reward": 1.0}])  # buffered: not resent yet
            tracker.log(2, {"loss": 0.25})
            tracker.close()  # one more try, then unsent.json
    finally:
        server.resume()
    ours = [r for r in caplog.records if r.name == "roll_core.trackers.mlflow"]
    assert tracker.backends == [] and len(ours) == 2
    warning, error = ours
    assert warning.levelno == logging.WARNING and "is not answering" in warning.getMessage()  # once per outage
    assert error.levelno == logging.ERROR and UNSENT_FILE in error.getMessage()
    unsent = json.loads((tmp_path / "mlflow" / UNSENT_FILE).read_text())
    assert unsent["run_id"] == run_id and sorted({m[3] for m in unsent["metrics"]}) == [1, 2]

    resumed = Tracker(tmp_path, config, ["mlflow"], resume=True)  # the server answers again: what waited is sent
    resumed.truncate(2)
    resumed.log(3, {"loss": 0.125})
    resumed.close()
    assert run_id_of(tmp_path) == run_id and not (tmp_path / "mlflow" / UNSENT_FILE).exists()
    client = server.client()
    assert read_run(client, run_id) == {0: {"loss": 1.0}, 1: {"loss": 0.5}, 2: {"loss": 0.25}, 3: {"loss": 0.125}}
    assert [m.value for m in client.get_metric_history(run_id, FAILURES_METRIC)] == [1.0, 2.0]  # failed sends
    assert sample_tables(client, run_id, tmp_path / "dl") == {1: [{"prompt": "Q", "response": "7", "reward": 1.0}]}
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_resume_while_the_server_is_away_goes_on_and_sends_its_steps_later(
    server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A resumed run (a preemption, a restart after a fault) whose server did not answer failed at once (a
    RuntimeError: "cannot start the run" / "cannot reach the run"). It goes on; once the server answers, the MLflow
    run is opened as the checkpoint says (here a new one: the old run holds step 2, which is redone) and sent every
    step from metrics.jsonl."""
    from roll_core.trackers.mlflow import read_run

    options = {"tracking_uri": server.url, "retries": 0, "timeout_s": 1, "retry_interval_s": 60}
    config = yaml.safe_dump({"experiment": "away", "tracking": {"mlflow": options}})
    first = Tracker(tmp_path, config, ["mlflow"])
    for step in range(3):
        first.log(step, {"loss": float(step)})
    first.close()
    old = run_id_of(tmp_path)
    resumed = Tracker(tmp_path, config, ["mlflow"], resume=True)
    server.pause()  # the server hangs while the run resumes from its checkpoint at step 1
    try:
        with caplog.at_level(logging.WARNING, logger="roll_core.trackers.mlflow"):
            resumed.truncate(1)  # no exception: training goes on
            began = time.monotonic()
            resumed.log(2, {"loss": 20.0})
            resumed.log(3, {"loss": 30.0})
            assert time.monotonic() - began < 0.5  # not tried again before retry_interval_s
            resumed.backends[0].wait()  # the worker's try to open the run timed out while the server hung
    finally:
        server.resume()
    with caplog.at_level(logging.WARNING, logger="roll_core.trackers.mlflow"):
        resumed.close()  # one more try: the server answers
    ours = [r for r in caplog.records if r.name == "roll_core.trackers.mlflow"]
    assert [r.levelno for r in ours] == [logging.WARNING] * 2  # no error: nothing is left unsent
    assert "is not answering" in ours[0].getMessage() and "answers again" in ours[1].getMessage()
    client, new = server.client(), run_id_of(tmp_path)
    assert new != old and client.get_run(new).data.tags["roll.resumed_from"] == old
    assert read_run(client, new) == {0: {"loss": 0.0}, 1: {"loss": 1.0}, 2: {"loss": 20.0}, 3: {"loss": 30.0}}
    assert client.get_run(new).info.status == "FINISHED"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_while_the_server_is_away_a_resend_is_one_request(tmp_path: Path) -> None:
    """Each resend to a hung server went through MLflow's own retries: `retries + 1` requests of `timeout_s` each
    (~47 s by default) held the training loop at every retry of the outage. Only the first failure retries. Once
    the server answers again, the next log sends what waited (not only close), each point at the time it was logged."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import DROPPED_METRIC, read_run

    options = {"retries": 1, "timeout_s": 1, "retry_interval_s": 0}
    tracker = Tracker(tmp_path, yaml.safe_dump({"experiment": "hung", "tracking": {"mlflow": options}}), ["mlflow"])
    tracker.log(0, {"loss": 0.0})
    backend, hung = tracker.backends[0], HungEndpoint()
    backend.wait()  # (sends run off the training thread) step 0 reached the store
    store = backend.client
    backend.client = MlflowClient(tracking_uri=hung.url)  # the server stops answering
    try:
        tracker.log(1, {"loss": 1.0})  # the first failure: MLflow retries it (retries=1: 2 requests)
        backend.wait()
        first = len(hung.connections)
        tracker.log(2, {"loss": 2.0})
        tracker.log(3, {"loss": 3.0})
        backend.wait()
        assert len(hung.connections) - first == 2  # one request per resend (2 each before)
    finally:
        hung.close()
    backend.client = store  # the server answers again
    tracker.log(4, {"loss": 4.0})
    backend.wait()
    run_id = run_id_of(tmp_path)
    assert read_run(store, run_id) == {s: {"loss": float(s)} for s in range(5)}  # before close: nothing waited
    points = store.get_metric_history(run_id, "loss")
    assert [p.step for p in sorted(points, key=lambda p: (p.timestamp, p.step))] == list(range(5))  # step order
    tracker.close()
    assert DROPPED_METRIC not in store.get_run(run_id).data.metrics  # nothing was dropped: no count of drops


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_an_outage_never_holds_the_training_loop(tmp_path: Path) -> None:
    """The first send to a hung server went through MLflow's retries on the training thread: `retries + 1` requests
    of `timeout_s` plus backoff (47.7 s at the defaults, measured) before `log` returned. Sends run off the training
    thread: `log` returns at once, and nothing is lost once the server answers."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import FAILURES_METRIC, read_run

    options = {"retries": 1, "timeout_s": 1, "retry_interval_s": 60}
    tracker = Tracker(tmp_path, yaml.safe_dump({"experiment": "hung", "tracking": {"mlflow": options}}), ["mlflow"])
    backend, hung = tracker.backends[0], HungEndpoint()
    store = backend.client
    backend.client = MlflowClient(tracking_uri=hung.url)  # the server stops answering once the run is created
    try:
        began = time.monotonic()
        for step in (1, 2, 3):
            tracker.log(step, {"loss": float(step)})
            tracker.samples(step, [{"prompt": "p", "response": "r", "reward": 1.0}])
        held = time.monotonic() - began
        assert held < 0.5, f"logging held the training loop {held:.1f}s"
        backend.wait()  # the worker's sends timed out meanwhile
        assert len(hung.connections) == 2  # the first failure and MLflow's retry of it, off the loop; then none
        # before retry_interval_s
    finally:
        hung.close()
    backend.client = store  # the server answers again
    tracker.close()
    run_id = run_id_of(tmp_path)
    assert read_run(store, run_id) == {s: {"loss": float(s)} for s in (1, 2, 3)}  # sent by close
    assert [m.value for m in store.get_metric_history(run_id, FAILURES_METRIC)] == [1.0]
    row = {"prompt": "p", "response": "r", "reward": 1.0}
    assert sample_tables(store, run_id, tmp_path / "dl") == {s: [row] for s in (1, 2, 3)}


ROW = {"prompt": "p", "response": "r", "reward": 1.0}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_close_stops_waiting_for_a_hung_server_at_close_timeout_s(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """close() waited for the request a hung server held when it was called, with MLflow's retries (`(retries + 1)
    * timeout_s` and backoff: ~11 s here, 63 s measured at the defaults), then `timeout_s` more for its own try.
    It returns at `close_timeout_s`: one error counts the points and tables not sent (the buffer's and those of the
    logs still queued behind the hung request), metrics.jsonl keeps every step, and a resume sends them."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import read_run

    config = _config(retries=2, timeout_s=3, retry_interval_s=0, close_timeout_s=3)
    tracker = Tracker(tmp_path, config, ["mlflow"])
    tracker.log(0, {"loss": 0.0, "reward": 0.0})
    backend, hung = tracker.backends[0], HungEndpoint()
    backend.wait()  # step 0 reached the store
    store, run_id = backend.client, run_id_of(tmp_path)
    backend.client = MlflowClient(tracking_uri=hung.url)  # the server hangs
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for step in range(1, 6):  # the worker hangs in step 1's send; steps 2-5 wait behind it
                tracker.log(step, {"loss": float(step), "reward": 1.0})
            tracker.samples(3, [ROW])
            hung.wait_for(1)  # step 1's send reached the server (with retries: ~11 s) before close()
            closing = _timed_close(tracker)
            ours = _mlflow_records(caplog)
    finally:
        hung.close()
    assert closing < 3 + 3, f"close() took {closing:.1f}s with close_timeout_s=3"
    assert tracker.backends == [] and backend.dropped == 10  # 5 steps of 2 points: counted as the buffer's drops
    assert len(ours) == 1 and ours[0][0] == logging.ERROR, ours
    message = ours[0][1]
    assert "did not answer within tracking.mlflow.close_timeout_s=3" in message
    assert "10 metric points (steps 1 to 5) and 1 sample tables were not sent" in message
    assert str(tmp_path / "metrics.jsonl") in message
    assert [r["step"] for r in Tracker.read_metrics(tmp_path / "metrics.jsonl")] == list(range(6))
    assert json.loads((tmp_path / "mlflow" / "end.json").read_text())["run_id"] == run_id  # not told it ended

    # The server answers again (the given-up worker's request holds up nothing: roll_core.trackers.mlflow_http).
    resumed = Tracker(tmp_path, _config(close_timeout_s=60), ["mlflow"], resume=True)
    resumed.truncate(5)
    resumed.close()
    assert run_id_of(tmp_path) == run_id  # run.json named only what the server had: the same run continues
    assert read_run(store, run_id) == {s: {"loss": float(s), "reward": float(s > 0)} for s in range(6)}
    assert sample_tables(store, run_id, tmp_path / "dl") == {3: [ROW]}
    assert store.get_run(run_id).info.status == "FINISHED" and not (tmp_path / "mlflow" / "end.json").exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_close_bounds_its_own_tries_by_close_timeout_s(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each log still queued at close tried a hung server for `timeout_s` (retry_interval_s=0): close() took
    `timeout_s` per queued step (22 s for 20 steps, measured). Requests made while closing get the time left before
    `close_timeout_s` (less its last second) and none starts after: the rest goes to unsent.json, as before."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import FAILURES_METRIC, UNSENT_FILE

    config = _config(retries=0, timeout_s=1, retry_interval_s=0, close_timeout_s=4)
    tracker = Tracker(tmp_path, config, ["mlflow"])
    tracker.log(0, {"loss": 0.0})
    backend, hung = tracker.backends[0], HungEndpoint()
    backend.wait()
    backend.client = MlflowClient(tracking_uri=hung.url)  # the server hangs
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for step in range(1, 21):
                tracker.log(step, {"loss": float(step)})
            closing = _timed_close(tracker)
    finally:
        hung.close()
    assert closing < 4 + 3, f"close() took {closing:.1f}s with close_timeout_s=4"
    ours = _mlflow_records(caplog)
    assert [level for level, _ in ours] == [logging.WARNING, logging.ERROR], ours  # not answering; unsent.json
    assert UNSENT_FILE in ours[1][1] and "stops waiting" not in ours[1][1]
    unsent = json.loads((tmp_path / "mlflow" / UNSENT_FILE).read_text())["metrics"]
    assert [m[3] for m in unsent if m[0] == "loss"] == list(range(1, 21))  # every step kept for the resume
    assert backend.dropped == 0 and {m[0] for m in unsent} == {"loss", FAILURES_METRIC}


def test_close_of_a_resumed_run_whose_hung_server_never_answered_is_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tracking URI is a hung server: a resumed run tries to open its MLflow run (MLflow's retries: ~11 s) and
    close() tried once more (~14 s in all). It returns at `close_timeout_s`, naming the steps MLflow lacks."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    hung = HungEndpoint()
    config = _config(tracking_uri=hung.url, retries=2, timeout_s=3, retry_interval_s=60, close_timeout_s=3)
    try:
        tracker = Tracker(tmp_path, config, ["mlflow"], resume=True)  # a resume reaches the server off the loop
        tracker.truncate(2)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            tracker.log(3, {"loss": 3.0})
            tracker.log(4, {"loss": 4.0})
            hung.wait_for(1)  # the try to open the run reached the server (with retries: ~11 s) before close()
            closing = _timed_close(tracker)
            ours = _mlflow_records(caplog)
    finally:
        hung.close()
    assert closing < 3 + 3, f"close() took {closing:.1f}s with close_timeout_s=3"
    assert len(ours) == 1 and ours[0][0] == logging.ERROR, ours
    assert "close_timeout_s=3" in ours[0][1] and "steps (up to 4) are not in MLflow" in ours[0][1]


def test_close_timeout_s_is_checked() -> None:
    from roll_core.config.tracking import MlflowConfig

    assert MlflowConfig().close_timeout_s == 30.0
    with pytest.raises(ValueError, match=r"tracking\.mlflow\.close_timeout_s: must be at least 3, got 2"):
        MlflowConfig(close_timeout_s=2)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_a_resume_replays_the_steps_the_continued_run_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a) Steps 0-2 with mlflow, 3-5 without it, then mlflow again: the continued MLflow run lacked 3-5. (b) A
    process that dies with points buffered (the server away; no close, so no unsent.json): run.json counted them as
    logged, and the resumed run never sent them."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import MlflowTracker, read_run

    cfg = "experiment: gap\n"
    for trackers, steps in ((["mlflow"], range(3)), ([], range(3, 6)), (["mlflow"], range(6, 8))):
        tracker = Tracker(tmp_path / "a", cfg, trackers, resume=steps.start > 0)
        if steps.start:
            tracker.truncate(steps.start - 1)
        for step in steps:
            tracker.log(step, {"loss": float(step)})
        tracker.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'a' / 'mlflow' / 'mlflow.db'}")
    assert read_run(client, run_id_of(tmp_path / "a")) == {s: {"loss": float(s)} for s in range(8)}

    tracker = Tracker(tmp_path / "b", cfg, ["mlflow"])
    for step in range(3):
        tracker.log(step, {"loss": float(step)})
    tracker.backends[0].wait()  # (sends run off the training thread) steps 0-2 reached the store

    class Down(Exception):
        error_code = "TEMPORARILY_UNAVAILABLE"

    def down(self: Any) -> None:
        raise Down("connection refused")

    with monkeypatch.context() as m:
        m.setattr(MlflowTracker, "_send", down)
        for step in (3, 4):
            tracker.log(step, {"loss": float(step)})
        tracker.backends[0].wait()  # (sends run off the training thread) both failed while the server was down
    assert json.loads((tmp_path / "b" / "mlflow" / "run.json").read_text())["last_step"] == 2  # what it holds
    # the process dies here (no close); the run resumes from its checkpoint at step 4
    resumed = Tracker(tmp_path / "b", cfg, ["mlflow"], resume=True)
    resumed.truncate(4)
    resumed.log(5, {"loss": 5.0})
    resumed.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'b' / 'mlflow' / 'mlflow.db'}")
    assert read_run(client, run_id_of(tmp_path / "b")) == {s: {"loss": float(s)} for s in range(6)}


def test_a_full_buffer_drops_the_oldest_points_and_tables(
    server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the bound the buffer grew without end while the server was away (every point and every sample table
    in memory for as long as the outage lasted). Past `max_buffered_points` / MAX_BUFFERED_TABLES the oldest are
    dropped: MLflow gets the newest when the server is back, the count, and a table list naming only what it has."""
    from roll_core.trackers import mlflow as backend_module
    from roll_core.trackers.mlflow import DROPPED_METRIC, MlflowTracker, read_run

    monkeypatch.setattr(backend_module, "MAX_BUFFERED_TABLES", 2)
    config = _config(tracking_uri=server.running().url, max_buffered_points=3, retry_interval_s=0)
    tracker = Tracker(tmp_path, config, ["mlflow"])
    backend = tracker.backends[0]
    row = {"prompt": "p", "response": "r", "reward": 1.0}
    tracker.log(0, {"loss": 0.0})
    tracker.samples(0, [row])
    backend.wait()

    class Down(Exception):
        error_code = "TEMPORARILY_UNAVAILABLE"

    def down(self: Any) -> None:
        raise Down("connection refused")

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with monkeypatch.context() as m:
            m.setattr(MlflowTracker, "_send", down)  # the server away (the test next to this one kills it)
            for step in range(1, 10):
                tracker.log(step, {"loss": float(step)})
                tracker.samples(step, [row])
            backend.wait()
            assert len(backend.pending_metrics) <= 3
            assert [p for p in backend.pending_artifacts if p.startswith("samples/")] == [
                "samples/step_000008.json",
                "samples/step_000009.json",
            ]
        tracker.close()  # the server answers again
    run_id = run_id_of(tmp_path)
    client = server.client()
    steps = sorted(read_run(client, run_id))
    assert steps[0] == 0 and steps[1:] == list(range(steps[1], 10)) and steps[1] > 1  # the newest kept
    dropped = backend.dropped
    assert dropped >= 9 - len(steps[1:]) and client.get_run(run_id).data.metrics[DROPPED_METRIC] == dropped
    tables = [a.path for a in client.list_artifacts(run_id, "samples")]
    assert tables == ["samples/step_000000.json", "samples/step_000008.json", "samples/step_000009.json"]
    shown = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert [t["path"] for t in shown] == tables  # the UI's list names only tables the run has
    ours = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert sum("buffer is full" in m for m in ours) == 1  # once per outage
    summary = [m for m in ours if "were dropped" in m]
    assert len(summary) == 1 and f"{dropped} metric points" in summary[0] and "and 7 sample tables" in summary[0]
    assert [r["step"] for r in Tracker.read_metrics(tmp_path / "metrics.jsonl")] == list(range(10))


def test_a_server_gone_for_good_leaves_the_points_in_unsent_json(
    server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It kills the module's server (connection refused from then on): the next test, the last, starts it again."""
    from roll_core.trackers.mlflow import UNSENT_FILE

    options = {"tracking_uri": server.url, "retries": 0, "retry_interval_s": 0}
    tracker = Tracker(tmp_path, yaml.safe_dump({"experiment": "gone", "tracking": {"mlflow": options}}), ["mlflow"])
    tracker.log(0, {"loss": 1.0})
    tracker.backends[0].wait()  # (sends run off the training thread) step 0 reached the server
    server.stop()  # SIGKILL of the server and its worker
    with caplog.at_level(logging.WARNING, logger="roll_core.trackers.mlflow"):
        tracker.log(1, {"loss": 0.5})
        tracker.log(2, {"loss": 0.25})
        tracker.close()
    assert [r.levelno for r in caplog.records if r.name == "roll_core.trackers.mlflow"] == [
        logging.WARNING,
        logging.ERROR,
    ]
    unsent = json.loads((tmp_path / "mlflow" / UNSENT_FILE).read_text())
    later = [(key, step, value) for key, value, _, step in unsent["metrics"]]
    count = "tracking/mlflow_send_failures"  # 1 when step 2 was logged; 3 after close's own try
    assert later == [("loss", 1, 0.5), ("loss", 2, 0.25), (count, 2, 1.0), (count, 2, 3.0)]


def test_a_run_ending_with_the_server_down_ends_in_bounded_time_and_counts_what_was_dropped(
    server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Last in this module: it leaves the server down. Killed after step 0 and never back, with a buffer of 4
    points: `close()` returns within seconds (MLflow's own defaults retried for minutes), an error says how many
    points were dropped and that metrics.jsonl keeps them, and unsent.json holds the newest for a resume."""
    from roll_core.trackers.mlflow import DROPPED_METRIC, UNSENT_FILE

    server.running()
    config = _config(tracking_uri=server.url, timeout_s=2, retry_interval_s=0, max_buffered_points=4)
    tracker = Tracker(tmp_path, config, ["mlflow"])
    backend = tracker.backends[0]
    tracker.log(0, {"loss": 0.0})
    backend.wait()
    server.stop()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        held = _timed_logs(tracker, range(1, 13))
        closing = _timed_close(tracker)
    assert held < 0.5 and closing < 15, (held, closing)  # the first refused send retries: ~3 s
    dropped = backend.dropped
    ours = _mlflow_records(caplog)
    full = [m for level, m in ours if level == logging.WARNING and "buffer is full" in m]
    summary = [m for level, m in ours if level == logging.ERROR and "were dropped" in m]
    assert len(full) == 1 and "max_buffered_points=4" in full[0] and "metrics.jsonl" in full[0]
    assert len(summary) == 1 and summary[0].startswith(f"MLflow: {dropped} metric points (steps 1 to ")
    assert str(tmp_path / "metrics.jsonl") in summary[0]
    unsent = json.loads((tmp_path / "mlflow" / UNSENT_FILE).read_text())["metrics"]
    assert len(unsent) <= 4 + 2  # the bound, and the final counts close adds
    assert (DROPPED_METRIC, float(dropped)) in [(m[0], m[1]) for m in unsent]
    kept = [m[3] for m in unsent if m[0] == "loss"]
    assert kept and kept == list(range(13 - len(kept), 13))  # the newest steps
    assert dropped >= 12 - len(kept)  # every loss point left out is counted (and count points dropped with them)
    assert [r["step"] for r in Tracker.read_metrics(tmp_path / "metrics.jsonl")] == list(range(13))  # kept locally


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_a_redo_while_the_server_is_away_opens_the_new_run_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart in the process redoes steps 2-3 of an open MLflow run while the server does not answer: the run
    replacing it could not be started, and `Unreachable` raised into training (the next call). Now it is warned
    about once, and the run is opened at a later log once the server answers: one new run with the folder's history
    (the redone values), the recorded one retired."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.testing.mlflow_server import free_port
    from roll_core.trackers.mlflow import read_run

    tracker = Tracker(tmp_path, _config(retries=0, timeout_s=2, retry_interval_s=0), ["mlflow"])
    backend = tracker.backends[0]
    for step in (1, 2, 3):
        tracker.log(step, {"loss": float(step)})
    backend.wait()
    store, recorded = backend.client, run_id_of(tmp_path)
    backend.client = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")  # nothing answers there
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tracker.truncate(1)  # restarted from the checkpoint at step 1: steps 2 and 3 are redone
        tracker.log(2, {"loss": 20.0})
        backend.wait()  # nothing raises into training
        assert backend.run_id is None and json.loads((tmp_path / "mlflow" / "run.json").read_text())["last_step"] == 1
        backend.client = store  # the server answers again
        tracker.log(3, {"loss": 30.0})
        tracker.close(failed=False)
    ours = _mlflow_records(caplog)
    assert [message for _, message in ours if "not answering" in message] == [ours[0][1]], ours
    assert all(level == logging.WARNING for level, _ in ours), ours
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    replaced = run_id_of(tmp_path)
    assert replaced != recorded and client.get_run(recorded).info.lifecycle_stage == "deleted"
    assert read_run(client, replaced) == {1: {"loss": 1.0}, 2: {"loss": 20.0}, 3: {"loss": 30.0}}
    assert client.get_run(replaced).data.tags["roll.resumed_from"] == recorded
