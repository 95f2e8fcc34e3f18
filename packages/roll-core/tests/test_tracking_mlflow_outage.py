"""MLflow tracking through a server outage: a real `mlflow server` (SQLite store, 127.0.0.1) killed in the middle of
a run and restarted on the same port, and the buffer's bound while it is away.

Covered: a log call never holds the training loop while the server is away; every step logged during the outage
reaches MLflow once the server is back, in step order; a run that ends with the server still down ends within a
bound and says how many points were dropped and where they are kept; a full buffer drops its oldest points and
sample tables, counted (`tracking/mlflow_dropped_points`) and warned about once per outage, and the run folder's
metrics.jsonl keeps every step. The server is started once per module and killed at the end, also on failure.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from roll_core.tracking import Tracker

LOGGER = "roll_core.trackers.mlflow"


class Server:
    """`mlflow server` on 127.0.0.1 with a SQLite store under `root`; `stop()` kills it (a server that goes away,
    connections refused), `start()` brings it back on the same port with the same store."""

    def __init__(self, root: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.root, self.url = root, f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 90.0) -> None:
        cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}", "--workers", "1"]
        cmd += ["--artifacts-destination", str(self.root / "artifacts")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job runner (needs huey; not what is tested)
        began = time.monotonic()
        with open(self.root / "server.log", "ab") as out:  # its own process group: stop() ends it and its worker
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() - began > timeout_s:
                self.stop()
                pytest.fail(f"mlflow server did not answer on {self.url}:\n{(self.root / 'server.log').read_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None

    def running(self) -> Server:
        if self.proc is None:
            self.start()
        return self

    def client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.url)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    pytest.importorskip("flask", reason="`mlflow server` needs Flask (roll-core's test extra)")
    srv = Server(tmp_path_factory.mktemp("mlflow-outage"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("MLFLOW_")]:
        monkeypatch.delenv(var)


def _config(**mlflow: Any) -> str:
    return yaml.safe_dump({"experiment": "outage", "tracking": {"mlflow": mlflow}})


def _run_id(run_dir: Path) -> str:
    return str(json.loads((run_dir / "mlflow" / "run.json").read_text())["run_id"])


def _timed_logs(tracker: Tracker, steps: range) -> float:
    """Log `loss = step` at each step; the longest a log call held the caller (seconds)."""
    longest = 0.0
    for step in steps:
        began = time.monotonic()
        tracker.log(step, {"loss": float(step)})
        longest = max(longest, time.monotonic() - began)
    return longest


def test_a_server_restarted_mid_run_receives_every_step(
    server: Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed after step 4 and back before step 15: the log calls meanwhile return at once, and steps 5-14, buffered,
    reach MLflow with the first log after the restart (not only at close), in step order."""
    from roll_core.trackers.mlflow import DROPPED_METRIC, FAILURES_METRIC, read_run

    server.running()
    config = _config(tracking_uri=server.url, timeout_s=2, retries=1, retry_interval_s=0)
    tracker = Tracker(tmp_path, config, ["mlflow"])
    backend = tracker.backends[0]
    _timed_logs(tracker, range(5))
    backend.wait()  # (sends run off the training thread) steps 0-4 reached the server
    run_id, client = _run_id(tmp_path), server.client()
    assert sorted(read_run(client, run_id)) == list(range(5))
    server.stop()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        held = _timed_logs(tracker, range(5, 15))
        assert held < 0.5, f"a log call held the training loop {held:.2f}s while the server was down"
        backend.wait()  # each send was refused: buffered
        server.start()  # the same port and store
        _timed_logs(tracker, range(15, 20))
        backend.wait()
    client = server.client()
    assert read_run(client, run_id) == {s: {"loss": float(s)} for s in range(20)}  # before close: nothing waited
    points = client.get_metric_history(run_id, "loss")
    assert [p.step for p in sorted(points, key=lambda p: (p.timestamp, p.step))] == list(range(20))  # step order
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 2 and "is not answering" in messages[0] and "answers again" in messages[1]
    tracker.close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and DROPPED_METRIC not in run.data.metrics
    assert run.data.metrics[FAILURES_METRIC] >= 1  # the refused sends, counted


def test_a_full_buffer_drops_the_oldest_points_and_tables(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
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
    run_id = _run_id(tmp_path)
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


def test_a_run_ending_with_the_server_down_ends_in_bounded_time_and_counts_what_was_dropped(
    server: Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
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
        began = time.monotonic()
        tracker.close()
        closing = time.monotonic() - began
    assert held < 0.5 and closing < 15, (held, closing)  # the first refused send retries: ~3 s
    dropped = backend.dropped
    ours = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
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
