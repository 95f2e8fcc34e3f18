"""MLflow backend, in the run folder's SQLite store (no server): metric and param names that must stay distinct, and
a refusal raised by the worker thread that sends (roll_core.trackers.mlflow, roll_core.trackers.background)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from roll_core.tracking import Tracker

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # (SQLAlchemy's, reading MLflow's sqlite store here)
]


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    for var in [v for v in os.environ if v.startswith("MLFLOW_")]:
        monkeypatch.delenv(var)


def _store(run_dir: Path) -> tuple[Any, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    return client, str(json.loads((run_dir / "mlflow" / "run.json").read_text())["run_id"])


def _suffixed(name: str, key: str) -> str:
    return f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def test_keys_that_read_the_same_in_mlflow_stay_distinct(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`a/b=c` becomes `a/b_c` in MLflow ('=' is refused), the name of another metric: both series were one, each
    step's second point overwriting the first in the charts. The later key gets a suffix (a valid key keeps its
    name), a warning says so, and a resume that continues the run names them as before (whatever their order)."""
    from roll_core.trackers.mlflow import FAILURES_METRIC, read_run

    cfg = yaml.safe_dump({"experiment": "keys", "x y=z": 1, "x y_z": 2})
    with caplog.at_level(logging.WARNING, logger="roll_core.trackers.mlflow"):
        tracker = Tracker(tmp_path, cfg, ["mlflow"])
        tracker.log(0, {"a/b=c": 1.0})  # named first: it has `a/b_c`
        tracker.log(1, {"a/b_c": 2.0, "a/b=c": 3.0, FAILURES_METRIC: 4.0})  # roll's own name is not a user's
        tracker.log(2, {"p:q=r": 5.0, "p:q_r": 6.0})  # first seen together: the valid key keeps its name
        tracker.close()
    moved = [r.getMessage() for r in caplog.records if "already names" in r.getMessage()]
    assert len(moved) == 4 and "param 'x y=z' is logged as 'x y_z-" in moved[0]  # once per key, not per step
    assert "metric 'a/b_c' is logged as 'a/b_c-" in moved[1] and "already names 'a/b=c'" in moved[1]

    resumed = Tracker(tmp_path, cfg, ["mlflow"], resume=True)
    resumed.truncate(2)  # the same MLflow run continues
    resumed.log(3, {"a/b_c": 7.0, "a/b=c": 8.0})  # the other order than its first naming
    resumed.close()
    client, run_id = _store(tmp_path)
    named_b, named_f, named_q = _suffixed("a/b_c", "a/b_c"), _suffixed(FAILURES_METRIC, FAILURES_METRIC), "p:q_r"
    assert read_run(client, run_id) == {
        0: {"a/b_c": 1.0},
        1: {named_b: 2.0, "a/b_c": 3.0, named_f: 4.0},
        2: {_suffixed("p:q_r", "p:q=r"): 5.0, named_q: 6.0},
        3: {named_b: 7.0, "a/b_c": 8.0},
    }
    params = client.get_run(run_id).data.params  # the config's keys: both kept
    assert (params["x y_z"], params[_suffixed("x y_z", "x y=z")]) == ("2", "1")


def test_a_refusal_on_the_worker_is_raised_by_the_next_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sends run off the training thread; a refusal that is not a network problem still reaches the caller (the
    next call raises it, with MLflow's message), the calls behind it wait, and the backend works on after it."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    from roll_core.trackers.mlflow import read_run

    tracker = Tracker(tmp_path, "experiment: refused\n", ["mlflow"])
    backend = tracker.backends[0]
    tracker.log(0, {"loss": 0.0})
    backend.wait()
    log_batch = backend.client.log_batch

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise MlflowException("value refused", error_code=INVALID_PARAMETER_VALUE)

    monkeypatch.setattr(backend.client, "log_batch", refuse)
    tracker.log(1, {"loss": 1.0})  # returns: the refusal happens on the worker
    with pytest.raises(MlflowException, match="value refused"):
        backend.wait()
    monkeypatch.setattr(backend.client, "log_batch", log_batch)
    tracker.log(2, {"loss": 2.0})  # works on: step 1 is still buffered, sent with step 2
    tracker.close()
    assert read_run(*_store(tmp_path)) == {s: {"loss": float(s)} for s in range(3)}
    with pytest.raises(RuntimeError, match="after close"):
        backend.log(3, {"loss": 3.0})


def test_a_literal_dotted_key_and_the_nested_one_it_reads_as_are_two_params(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config with a literal `a.b` key beside a nested `a: {b: ...}` flattened both to the param `a.b`, the second
    silently overwriting the first (MLflow showed one value of two). The nested one keeps `a.b`; the literal one is
    `a.b-<digest of its path>`, with a warning naming it; a resume that continues the run names them as before."""
    from roll_core.trackers.mlflow import flatten_config

    config = {"experiment": "dots", "a.b": 1, "a": {"b": 2, "c.d": 3, "c": {"d": 4}}, "x.y": 5}
    literal = {k: _suffixed(k, json.dumps(path)) for k, path in (("a.b", ["a.b"]), ("a.c.d", ["a", "c.d"]))}
    with caplog.at_level(logging.WARNING, logger="roll_core.trackers.mlflow"):
        tracker = Tracker(tmp_path, yaml.safe_dump(config), ["mlflow"])
        tracker.log(0, {"loss": 1.0})
        tracker.close()
    client, run_id = _store(tmp_path)
    params = client.get_run(run_id).data.params
    want = {"a.b": "2", literal["a.b"]: "1", "a.c.d": "4", literal["a.c.d"]: "3", "x.y": "5"}
    assert {k: v for k, v in params.items() if k.startswith(("a.", "x."))} == want
    said = [r.getMessage() for r in caplog.records if "reads as" in r.getMessage()]
    assert len(said) == 2 and f"'a.b' is logged as {literal['a.b']!r}" in said[0], said
    assert flatten_config(config) == params  # the same names at every call (a resume compares them)

    resumed = Tracker(tmp_path, yaml.safe_dump(config), ["mlflow"], resume=True)
    resumed.truncate(0)  # continued: its params are the run's, unchanged
    resumed.log(1, {"loss": 0.5})
    resumed.close()
    assert _store(tmp_path)[1] == run_id and client.get_run(run_id).data.params == params
