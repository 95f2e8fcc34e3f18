"""MLflow tracking against a real tracking server that the tests start (`mlflow server`, SQLite store, 127.0.0.1).

Everything is read back through MLflow's own client (`MlflowClient`): runs, params, metric histories, artifacts.
Covered: the conformance suite (roll_core.testing.trackers) against the server; a tiny roll run with
`pipeline.trackers=[mlflow]` (experiment, run name, the flattened config as params, every metric of metrics.jsonl
at its step, the sample tables, config.yaml); a resume that redoes steps (a new run replays the kept steps, the
old one is retired); the server stopped mid-run (training goes on, points are buffered, counted and sent once it
is back, through `unsent.json` across a restart); a resume while the server hangs (it goes on, the MLflow run is
opened later); a hung endpoint that never answers (one request per resend, never on the training thread); a
resume that replays the steps the continued run lacks; credentials kept out of MLflow and of errors. The server is
started once per module (`--workers 1`) and killed at the end, also on failure. The run folder's own SQLite store
(no server): test_tracking_mlflow_store.py.
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
import traceback
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from roll_core.testing.trackers import FIRST_ATTEMPT, TrackerTestSuite, assert_steps
from roll_core.tracking import Tracker

#: A smaller tiny run than tiny_overrides' (what is tested is the tracking, not the learning).
SMALLER = ["algo.group_size=2", "pipeline.rollout_batch_size=2", "env.eval_size=2", "pipeline.eval_size=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store and served artifacts under `root`; restartable on its port."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0

    def start(self, timeout_s: float = 90.0) -> None:
        cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}", "--workers", "1"]
        cmd += ["--artifacts-destination", str(self.root / "artifacts")]
        # No job runner (it needs huey and is not what is tested); no user's tracking settings.
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        began = time.monotonic()
        with open(self.root / "server.log", "ab") as out:  # the server's own process group: stop() ends both
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() - began > timeout_s:
                self.stop()
                log = (self.root / "server.log").read_text()[-3000:]
                pytest.fail(f"mlflow server did not answer on {self.url} within {timeout_s}s:\n{log}")
            time.sleep(0.1)
        self.start_s = time.monotonic() - began

    def stop(self) -> None:
        if self.proc is None:
            return
        try:  # the server and its uvicorn worker, at once: a server that goes away, not one that shuts down
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections are accepted by the kernel, nothing answers)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.url)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    pytest.importorskip("flask", reason="`mlflow server` needs Flask (roll-core's test extra)")
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        srv.start()
        print(f"mlflow server started in {srv.start_s:.1f}s")
        yield srv
    finally:
        srv.stop()


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("MLFLOW_")]:
        monkeypatch.delenv(var)


def _run_id(run_dir: Path) -> str:
    return str(json.loads((run_dir / "mlflow" / "run.json").read_text())["run_id"])


def _tables(client: Any, run_id: str, dst: Path) -> dict[int, list[dict[str, Any]]]:
    """The run's sample tables by step, as MLflow's artifact store holds them."""
    if not client.list_artifacts(run_id, "samples"):
        return {}
    folder = Path(client.download_artifacts(run_id, "samples", str(dst)))
    tables = {}
    for file in sorted(folder.glob("step_*.json")):
        table = json.loads(file.read_text())
        rows = [dict(zip(table["columns"], row)) for row in table["data"]]
        step = int(file.stem.removeprefix("step_"))
        assert all(row.pop("step") == step for row in rows)
        tables[step] = rows
    return tables


def _config_artifact(client: Any, run_id: str, dst: Path) -> str:
    return Path(client.download_artifacts(run_id, "config.yaml", str(dst))).read_text()


class TestMlflowConformance(TrackerTestSuite):
    tracker = "mlflow"

    @pytest.fixture(autouse=True)
    def _uri(self, server: MlflowServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.server, self.downloads = server, tmp_path / "downloads"
        options = {"tracking_uri": server.url, "experiment": "conformance", "retries": 0}
        monkeypatch.setattr(type(self), "run_config", {"tracking": {"mlflow": options}})

    def read_back(self, run_dir: Path) -> dict[int, dict[str, float]]:
        from roll_core.trackers.mlflow import read_run

        return read_run(self.server.client(), _run_id(run_dir))

    def read_samples(self, run_dir: Path) -> dict[int, list[dict[str, Any]]]:
        return _tables(self.server.client(), _run_id(run_dir), self.downloads / "samples")

    def read_config(self, run_dir: Path) -> dict[str, Any]:
        return yaml.safe_load(_config_artifact(self.server.client(), _run_id(run_dir), self.downloads / "config"))

    def test_redone_steps_start_a_new_run_and_retire_the_old(self, tmp_path: Path) -> None:
        from roll_core.trackers.mlflow import read_run

        self._first_attempt(tmp_path, range(4))
        first = _run_id(tmp_path)
        resumed = self.build(tmp_path, resume=True)
        resumed.truncate(1)
        resumed.log(2, {"loss": 9.0})
        resumed.close()
        client, second = self.server.client(), _run_id(tmp_path)
        old, new = client.get_run(first), client.get_run(second)
        assert second != first and new.info.run_name == old.info.run_name == "conformance"
        assert new.info.experiment_id == old.info.experiment_id
        assert new.data.tags["roll.resumed_from"] == first and old.data.tags["roll.superseded_by"] == second
        assert old.info.lifecycle_stage == "deleted" and old.info.status == "KILLED"  # restorable, not shown
        assert new.info.status == "FINISHED"
        assert_steps(read_run(client, first), FIRST_ATTEMPT)  # the retired run keeps what it had
        # The new run's history is plain: one point per logged step (nothing for a reader to filter).
        assert [(p.step, p.value) for p in client.get_metric_history(second, "loss")] == [(1, 1.5), (2, 9.0)]


def test_tiny_run_reads_back_through_the_mlflow_client(server: MlflowServer, tmp_path: Path) -> None:
    from roll_core.testing import constant_answer_task, run_pipeline, tiny_overrides
    from roll_core.trackers.mlflow import flatten_config, read_run

    out = tmp_path / "run"
    overrides = ["pipeline.max_steps=2", "pipeline.trackers=[mlflow]", f"tracking.mlflow.tracking_uri={server.url}"]
    overrides += ["+tracking.mlflow.tags.team=rl", *SMALLER]
    _, history = run_pipeline(tiny_overrides(constant_answer_task(tmp_path / "seven.jsonl"), out, *overrides))

    client, run_id = server.client(), _run_id(out)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "rlvr"  # no group: the experiment name
    assert (run.info.run_name, run.info.status, run.data.tags["team"]) == ("rlvr", "FINISHED", "rl")
    config_text = (out / "config.yaml").read_text()
    assert _config_artifact(client, run_id, tmp_path / "dl") == config_text  # the whole resolved config
    params = flatten_config(yaml.safe_load(config_text))
    assert run.data.params == params and params["algo.lr"] == "0.003" and params["pipeline.max_steps"] == "2"

    assert [h["step"] for h in history][-2:] == [1, 2]
    assert_steps(read_run(client, run_id), {h["step"]: {k: v for k, v in h.items() if k != "step"} for h in history})
    for key in run.data.metrics:  # each history as MLflow stores it: one point per step, no duplicates
        points = [(p.step, p.value) for p in client.get_metric_history(run_id, key)]
        assert points == [(h["step"], pytest.approx(h[key])) for h in history if h.get(key) is not None], key
    samples: dict[int, list[dict[str, Any]]] = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        samples.setdefault(row.pop("step"), []).append(row)
    assert samples and _tables(client, run_id, tmp_path / "dl") == samples
    shown = json.loads(run.data.tags["mlflow.loggedArtifacts"])  # the UI lists them as tables
    assert shown == [{"path": f"samples/step_{s:06d}.json", "type": "table"} for s in sorted(samples)]


def test_a_hung_server_loses_nothing(server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from roll_core.trackers.mlflow import FAILURES_METRIC, UNSENT_FILE, read_run

    options = {"tracking_uri": server.url, "retries": 0, "retry_interval_s": 60}
    config = yaml.safe_dump({"experiment": "outage", "tracking": {"mlflow": options}})
    tracker = Tracker(tmp_path, config, ["mlflow"])
    tracker.log(0, {"loss": 1.0})
    tracker.backends[0].wait()  # (sends run off the training thread) step 0 reached the server
    run_id = _run_id(tmp_path)
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
    assert _run_id(tmp_path) == run_id and not (tmp_path / "mlflow" / UNSENT_FILE).exists()
    client = server.client()
    assert read_run(client, run_id) == {0: {"loss": 1.0}, 1: {"loss": 0.5}, 2: {"loss": 0.25}, 3: {"loss": 0.125}}
    assert [m.value for m in client.get_metric_history(run_id, FAILURES_METRIC)] == [1.0, 2.0]  # failed sends
    assert _tables(client, run_id, tmp_path / "dl") == {1: [{"prompt": "Q", "response": "7", "reward": 1.0}]}
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
    old = _run_id(tmp_path)
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
    client, new = server.client(), _run_id(tmp_path)
    assert new != old and client.get_run(new).data.tags["roll.resumed_from"] == old
    assert read_run(client, new) == {0: {"loss": 0.0}, 1: {"loss": 1.0}, 2: {"loss": 20.0}, 3: {"loss": 30.0}}
    assert client.get_run(new).info.status == "FINISHED"


class HungEndpoint:
    """A TCP endpoint on 127.0.0.1 that accepts connections and never answers (a hung server), counting them: each
    HTTP request MLflow sends (a retry too) is a connection."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                self.connections.append(self.sock.accept()[0])
            except OSError:  # closed
                return

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (a close alone does not)
        self.sock.close()
        self.thread.join(timeout=5)
        for conn in self.connections:
            conn.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_while_the_server_is_away_a_resend_is_one_request(tmp_path: Path) -> None:
    """Each resend to a hung server went through MLflow's own retries: `retries + 1` requests of `timeout_s` each
    (~47 s by default) held the training loop at every retry of the outage. Only the first failure retries."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import read_run

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
    tracker.close()
    assert read_run(store, _run_id(tmp_path)) == {s: {"loss": float(s)} for s in range(4)}


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
    run_id = _run_id(tmp_path)
    assert read_run(store, run_id) == {s: {"loss": float(s)} for s in (1, 2, 3)}  # sent by close
    assert [m.value for m in store.get_metric_history(run_id, FAILURES_METRIC)] == [1.0]
    row = {"prompt": "p", "response": "r", "reward": 1.0}
    assert _tables(store, run_id, tmp_path / "dl") == {s: [row] for s in (1, 2, 3)}


#: A config carrying credentials: a tracking URI with `user:token@`, a reward header, a token (and non-secrets).
def _secret_config(uri: str) -> dict[str, Any]:
    return {
        "experiment": "secrets",
        "tracking": {"mlflow": {"tracking_uri": uri, "retries": 0, "timeout_s": 5}},
        "env": {"reward": {"headers": {"X-API-Key": "key-123", "Accept": "json"}, "api_key_env": "JUDGE_KEY"}},
        "hf_token": "hf_abc",
        "algo": {"max_tokens": 8},
    }


def test_credentials_in_the_config_reach_neither_mlflow_nor_run_json(server: MlflowServer, tmp_path: Path) -> None:
    """Params, the config.yaml artifact and run.json hold no credential; the run folder's config.yaml is kept whole,
    and a resume still finds its run (run.json's URI without userinfo names the same store)."""
    uri = server.url.replace("http://", "http://alice:s3cr3t@")
    cfg = yaml.safe_dump(_secret_config(uri))
    tracker = Tracker(tmp_path, cfg, ["mlflow"])
    tracker.log(0, {"loss": 1.0})
    tracker.close()
    client, run_id = server.client(), _run_id(tmp_path)
    params = client.get_run(run_id).data.params
    artifact = _config_artifact(client, run_id, tmp_path / "dl")
    state = (tmp_path / "mlflow" / "run.json").read_text()
    for sent in (json.dumps(params), artifact, state):
        assert not any(secret in sent for secret in ("s3cr3t", "alice", "key-123", "hf_abc")), sent
    shown = server.url.replace("http://", "http://***@")
    assert params["tracking.mlflow.tracking_uri"] == shown and json.loads(state)["tracking_uri"] == shown
    assert params["env.reward.headers.X-API-Key"] == params["hf_token"] == "***"
    assert (params["env.reward.headers.Accept"], params["env.reward.api_key_env"]) == ("json", "JUDGE_KEY")
    assert params["algo.max_tokens"] == "8" and yaml.safe_load(artifact)["env"]["reward"]["headers"]["Accept"] == "json"
    assert (tmp_path / "config.yaml").read_text() == cfg  # the user's own file
    resumed = Tracker(tmp_path, cfg, ["mlflow"], resume=True)
    resumed.truncate(0)
    resumed.log(1, {"loss": 0.5})
    resumed.close()
    assert _run_id(tmp_path) == run_id


def test_an_error_names_the_tracking_uri_without_its_credentials(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    uri = f"http://alice:s3cr3t@127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(RuntimeError, match="cannot start the run") as err:
        Tracker(tmp_path, yaml.safe_dump(_secret_config(uri)), ["mlflow"])
    assert "s3cr3t" not in str(err.value) and "http://***@127.0.0.1:" in str(err.value)
    # What a crash prints: the whole chain. MLflow's own exception, chained as the cause, named the URI with its
    # `alice:s3cr3t@` ("API request to http://alice:s3cr3t@127.0.0.1:.../get-by-name failed ...").
    printed = "".join(traceback.format_exception(err.value))
    assert "direct cause" in printed and "API request to http://***@127.0.0.1:" in printed  # the cause, redacted
    assert "s3cr3t" not in printed and "alice" not in printed


def test_a_server_gone_for_good_leaves_the_points_in_unsent_json(
    server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Last in this module: it kills the module's server (connection refused from then on)."""
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
    assert read_run(client, _run_id(tmp_path / "a")) == {s: {"loss": float(s)} for s in range(8)}

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
    assert read_run(client, _run_id(tmp_path / "b")) == {s: {"loss": float(s)} for s in range(6)}
