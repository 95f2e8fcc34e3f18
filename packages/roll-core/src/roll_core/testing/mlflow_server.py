"""A real MLflow tracking server for tests of the MLflow backend (roll_core.trackers.mlflow), and what they share.

`serve(root)` starts `mlflow server` on 127.0.0.1 (a free port, `--workers 1`, a SQLite store and served artifacts
under `root`, the server's output in `root/server.log`), yields it as an `MlflowServer` once `/health` answers and
kills it on exit, also on failure; it skips the test when mlflow or Flask (roll-core's `mlflow` and test extras) is
missing, and fails it with the server's log when the server does not answer within `timeout_s`. Use it from a
module-scoped fixture: a start takes seconds.

An `MlflowServer` can go away the ways a real one does: `stop()` kills it and its worker at once (connections
refused), `pause()` / `resume()` hang it and let it go on (connections accepted, nothing answered), and `start()` or
`running()` bring it back on the same port with the same store. The server runs without the caller's `MLFLOW_*`
settings and without its job runner.

`HungEndpoint()` is a server that hangs from the start: it accepts connections and never answers, counting them
(each HTTP request MLflow sends, a retry too, is a connection).

Shared helpers: `free_port()`, `clear_mlflow_env(monkeypatch)` (a test sees none of the user's `MLFLOW_*`
settings), `run_id_of(run_dir)` (the MLflow run a run folder's tracker logs to) and `sample_tables(client, run_id,
dst)` (a run's sample tables as MLflow stores them). mlflow is imported only where a function needs it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

__all__ = ["HungEndpoint", "MlflowServer", "clear_mlflow_env", "free_port", "run_id_of", "sample_tables", "serve"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a SQLite store and served artifacts under `root`; restartable on its port."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0  # how long the last start took

    def start(self, timeout_s: float = 90.0) -> None:
        """Start the server (on the same port and store as before) and wait until `/health` answers."""
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
        """SIGKILL the server and its worker (nothing if it is not running)."""
        if self.proc is None:
            return
        try:  # the server and its uvicorn worker, at once: a server that goes away, not one that shuts down
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None

    def running(self) -> MlflowServer:
        """This server, started again if a test stopped it."""
        if self.proc is None:
            self.start()
        return self

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections are accepted by the kernel, nothing answers)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: a paused server answers again."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def client(self) -> Any:
        """An `MlflowClient` of this server."""
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.url)


@contextmanager
def serve(root: Path) -> Iterator[MlflowServer]:
    """A started `MlflowServer` under `root`, killed on exit; skips the test without mlflow or Flask."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    pytest.importorskip("flask", reason="`mlflow server` needs Flask (roll-core's test extra)")
    server = MlflowServer(root)
    try:
        server.start()
        print(f"mlflow server started in {server.start_s:.1f}s")
        yield server
    finally:
        server.stop()


def clear_mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every `MLFLOW_*` variable for this test (`monkeypatch` puts them back): none of the user's settings."""
    for var in [v for v in os.environ if v.startswith("MLFLOW_")]:
        monkeypatch.delenv(var)


def run_id_of(run_dir: Path) -> str:
    """The MLflow run id the run folder's tracker saved (`<run_dir>/mlflow/run.json`)."""
    return str(json.loads((run_dir / "mlflow" / "run.json").read_text())["run_id"])


def sample_tables(client: Any, run_id: str, dst: Path) -> dict[int, list[dict[str, Any]]]:
    """The run's sample tables by step, as MLflow's artifact store holds them (downloaded under `dst`); each row's
    `step` column is checked against its table's step and left out."""
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


class HungEndpoint:
    """A TCP endpoint on 127.0.0.1 that accepts connections and never answers (a hung server), counting them: each
    HTTP request MLflow sends (a retry too) is a connection. `close()` when done."""

    def __init__(self) -> None:
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

    def wait_for(self, connections: int, timeout_s: float = 60.0) -> None:
        """Block until `connections` requests reached the endpoint (AssertionError after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while len(self.connections) < connections:
            assert time.monotonic() < deadline, f"{len(self.connections)} of {connections} requests came"
            time.sleep(0.01)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (a close alone does not)
        self.sock.close()
        self.thread.join(timeout=5)
        for conn in self.connections:
            conn.close()
