"""The end of an MLflow run that `close()` could not tell the server (roll_core.trackers.mlflow): the run would stay
RUNNING in MLflow for good, a run that never ended.

When `close()` gives up on a hung server (`tracking.mlflow.close_timeout_s`), or its own tries fail, or the server
does not take the status, the run's final status (FINISHED, or FAILED when closed while an exception propagates)
and the time it ended are
- recorded in `<run>/mlflow/end.json` (END_FILE: {"run_id", "status", "end_time"}), the local record of what MLflow
  was not told, next to unsent.json (the points it was not sent);
- delivered by `deliver_end`: a daemon thread of this process tries again, one request of `timeout_s` at a time,
  after `retry_interval_s` (at least 1 s) doubling up to MAX_RETRY_INTERVAL_S, for at most END_DELIVERY_S; once the
  server takes it, the run shows its status and end time (the time `close()` was called) and end.json is removed.
  Its requests hold up nothing else (roll_core.trackers.mlflow_http: no lock across a request).
- A resume of the run folder that reopens the run (continues it, or supersedes it: KILLED) makes the record moot: it
  stops this process's delivery (`reopened`) and removes end.json; the continued run's own `close()` ends it. A
  process that exits first leaves end.json: the run stays RUNNING until the run resumes (or someone calls
  `MlflowClient().set_terminated(run_id, status, end_time)` with end.json's values).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from roll_core.trackers.mlflow_http import bounded_http, is_network_error
from roll_core.tracking import redact_text

__all__ = [
    "END_DELIVERY_S",
    "END_FILE",
    "MAX_RETRY_INTERVAL_S",
    "deliver_end",
    "read_end",
    "record_end",
    "reopened",
    "stop_deliveries",
]

log = logging.getLogger("roll_core.trackers.mlflow")  # the backend's logger: all its messages under one name
#: The run folder's record of a final status MLflow was not told (in `<run>/mlflow/`).
END_FILE = "end.json"
#: How long this process keeps trying to deliver a final status (seconds).
END_DELIVERY_S = 3600.0
#: The longest wait between two tries (here, and between the resends of roll_core.trackers.mlflow's buffer).
MAX_RETRY_INTERVAL_S = 300.0
# run id -> set when a resume reopened the run in this process: its delivery stops.
_delivering: dict[str, threading.Event] = {}
_lock = threading.Lock()  # around `_delivering` only (no request is made under it)


def record_end(folder: Path, run_id: str, status: str, end_time: int) -> dict[str, Any]:
    """Write `folder/END_FILE` (atomically) for `run_id`; the record."""
    record = {"run_id": run_id, "status": status, "end_time": end_time}
    tmp = folder / f"{END_FILE}.{threading.get_ident()}.tmp"  # `close()` and the worker may both write it
    tmp.write_text(json.dumps(record))
    tmp.replace(folder / END_FILE)
    return record


def read_end(folder: Path) -> dict[str, Any] | None:
    """The record in `folder/END_FILE`, None when there is none (or it cannot be read: a crash mid-write)."""
    try:
        return dict(json.loads((folder / END_FILE).read_text()))
    except (OSError, ValueError):
        return None


def _forget(folder: Path, record: dict[str, Any]) -> None:
    """Remove END_FILE if it still holds `record` (a later attempt may have written its own since)."""
    if read_end(folder) == record:
        (folder / END_FILE).unlink(missing_ok=True)


def reopened(folder: Path, run_id: str) -> None:
    """A resume reopened `run_id` (continued or superseded): stop delivering its old status and drop its record."""
    with _lock:
        stop = _delivering.get(run_id)
    if stop is not None:
        stop.set()
    record = read_end(folder)
    if record is not None and record.get("run_id") == run_id:
        _forget(folder, record)


def stop_deliveries() -> None:
    """Stop every delivery of this process at its next wait (their records stay: a resume ends the runs). For a
    process that must not talk to the servers any more; tests, so that no delivery outlives its test."""
    with _lock:
        stops = list(_delivering.values())
    for stop in stops:
        stop.set()


def deliver_end(
    client: Any, folder: Path, record: dict[str, Any], *, timeout_s: float, retry_interval_s: float, shown_uri: str
) -> threading.Thread:
    """Start the daemon thread that tells the server `record` (`record_end`'s) with a bounded retry (the module
    docstring); the thread, for tests to join."""
    run_id, stop = str(record["run_id"]), threading.Event()
    with _lock:
        previous = _delivering.get(run_id)
        if previous is not None:  # an earlier close() of the same run: this record is the newer
            previous.set()
        _delivering[run_id] = stop

    def deliver() -> None:
        wait, deadline = max(1.0, retry_interval_s), time.monotonic() + END_DELIVERY_S
        try:
            while not stop.wait(min(wait, max(0.0, deadline - time.monotonic()))):
                try:
                    with bounded_http(timeout_s, 0):  # one request a try: the next try is this loop's
                        client.set_terminated(run_id, record["status"], end_time=record["end_time"])
                except Exception as exc:
                    if is_network_error(exc) and time.monotonic() < deadline:
                        wait = min(wait * 2, MAX_RETRY_INTERVAL_S)
                        continue
                    why = redact_text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)[:300]
                    log.error(
                        "MLflow at %s: the status %s of run %s was not delivered (%s); %s keeps it",
                        *(shown_uri, record["status"], run_id, why, folder / END_FILE),
                    )
                    return
                if not stop.is_set():
                    _forget(folder, record)
                    log.warning("MLflow at %s answers again: run %s is marked %s", shown_uri, run_id, record["status"])
                return
        finally:
            with _lock:
                if _delivering.get(run_id) is stop:
                    del _delivering[run_id]

    thread = threading.Thread(target=deliver, name=f"roll-mlflow-end-{run_id[:8]}", daemon=True)
    thread.start()
    return thread
