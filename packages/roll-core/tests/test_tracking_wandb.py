"""W&B tracking, offline (no network, no account): what a run writes is read back from W&B's own run files.

W&B's offline run file (`<run>/wandb/offline-run-*/run-<id>.wandb`) is a LevelDB-style log of W&B's protobuf
`Record` messages (`wandb.proto.wandb_internal_pb2`), the file `wandb sync` uploads; W&B's Python SDK no longer
ships a reader for it (its datastore moved into the wandb-core binary), so `_records` below decodes the framing
(32 KiB blocks of CRC-checked chunks after a 7-byte header) and W&B's own protobufs decode the records. Covered:
the conformance suite (roll_core.testing.trackers), a tiny run with `pipeline.trackers=[tensorboard,wandb]`
(every metric of metrics.jsonl at its step, the resolved config, the sample tables), a Hydra multirun whose jobs
share one W&B group with distinct names, and the one-line error without the package.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from roll_core.testing.trackers import TrackerTestSuite
from roll_core.tracking import Tracker

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # ident, magic, version
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[Any]:
    """W&B's protobuf records of one offline run file, in order (CRC of each chunk checked)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[: len(HEADER)] == HEADER, f"{path} is not a W&B run file"
    pos, pending = len(HEADER), b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: bad chunk at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _finished(file: Path, timeout_s: float = 60.0) -> list[Any]:
    """The records of a finished run file. `run.finish()` returns before W&B's service process has flushed an
    offline run to disk, so wait for the run's `exit` record."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(_records(file))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{file}: no exit record after {timeout_s}s"
        time.sleep(0.1)


def _runs(run_dir: Path) -> list[dict[str, Any]]:
    """Every offline W&B run under `<run>/wandb`, oldest first: id, name, group, config, history, tables."""
    runs = []
    for file in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        run: dict[str, Any] = {"history": {}, "tables": {}, "config": {}}
        for record in _finished(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, name=record.run.display_name, group=record.run.run_group)
                run["time"] = record.run.start_time.ToNanoseconds()
                run["tags"] = list(record.run.tags)
                run["config"] = {i.key: json.loads(i.value_json) for i in record.run.config.update}
                run["config"].pop("_wandb", None)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                step = items["_step"]
                if "samples/path" in items:
                    table = json.loads((file.parent / "files" / items["samples/path"]).read_text())
                    run["tables"][step] = [dict(zip(table["columns"], row)) for row in table["data"]]
                metrics = {k: v for k, v in items.items() if not k.startswith(("_", "samples/"))}
                run["history"].setdefault(step, {}).update(metrics)
        runs.append(run)
    return sorted(runs, key=lambda r: r["time"])


def _current(run_dir: Path) -> list[dict[str, Any]]:
    """The offline files of the W&B run the run folder records (a resumed W&B run has one per attempt)."""
    state = json.loads((run_dir / "wandb" / "roll-run.json").read_text())
    return [r for r in _runs(run_dir) if r["id"] == state["id"]]


class TestWandbConformance(TrackerTestSuite):
    tracker = "wandb"
    run_config: ClassVar[dict[str, Any]] = {"tracking": {"wandb": {"mode": "offline", "project": "conformance"}}}

    def read_back(self, run_dir: Path) -> dict[int, dict[str, float]]:
        shown: dict[int, dict[str, float]] = {}
        for run in _current(run_dir):
            for step, metrics in run["history"].items():
                if metrics:
                    shown.setdefault(step, {}).update(metrics)
        return shown

    def read_samples(self, run_dir: Path) -> dict[int, list[dict[str, Any]]]:
        tables: dict[int, list[dict[str, Any]]] = {}
        for run in _current(run_dir):
            for step, rows in run["tables"].items():
                assert all(row.pop("step") == step for row in rows)
                tables[step] = rows
        return tables

    def read_config(self, run_dir: Path) -> dict[str, Any]:
        return _current(run_dir)[0]["config"]


@pytest.fixture(autouse=True)
def _no_account(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials reach these tests, so `mode=auto` must choose offline; W&B's own settings stay in tmp."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


def test_auto_mode_is_online_only_with_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_core.trackers.wandb import resolve_mode

    assert resolve_mode("auto") == "offline"  # no key, no login: W&B never tries the network
    assert resolve_mode("online") == "online" and resolve_mode("disabled") == "disabled"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # what `wandb login` writes
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # W&B's own switch wins
    assert resolve_mode("auto") == "disabled"


def test_sweep_of_tiny_runs_with_tensorboard_and_wandb(tmp_path: Path) -> None:
    """Two jobs of a local multirun (Hydra's basic launcher), each a 2-step tiny run with both trackers: W&B holds
    every metric of the job's metrics.jsonl at its step, the resolved config and the sample tables; the jobs are
    one group with distinct names."""
    pytest.importorskip("wandb", reason="the roll-core[wandb] extra")
    from roll_core.testing import constant_answer_task, tiny_overrides

    data = constant_answer_task(tmp_path / "seven.jsonl")
    sweep = tmp_path / "sweep"
    overrides = [o for o in tiny_overrides(data, "unused") if not o.startswith("pipeline.output_dir=")]
    overrides += ["pipeline.max_steps=2", "pipeline.trackers=[tensorboard,wandb]", "algo.lr=1e-3,3e-3"]
    cmd = [str(Path(sys.executable).parent / "roll-train"), "-m", *overrides, f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]

    runs = []
    for job in ("0", "1"):
        (run,) = _runs(sweep / job)
        runs.append(run)
        assert run["config"] == yaml.safe_load((sweep / job / "config.yaml").read_text())  # all of it, resolved
        history = Tracker.read_metrics(sweep / job / "metrics.jsonl")
        assert [h["step"] for h in history] == [1, 2] and set(run["history"]) == {1, 2}
        for record in history:  # every finite metric of metrics.jsonl, at its step
            logged = {k: v for k, v in record.items() if k != "step" and v is not None}
            assert run["history"][record["step"]] == pytest.approx(logged), record["step"]
        samples: dict[int, list[dict[str, Any]]] = {}
        for line in (sweep / job / "samples.jsonl").read_text().splitlines():
            row = json.loads(line)
            samples.setdefault(row["step"], []).append(row)
        assert samples and run["tables"] == samples  # one table per step, row for row
        assert (sweep / job / "tensorboard").is_dir()  # both backends at once
    assert runs[0]["group"] == runs[1]["group"] == "rlvr-sweep"  # <experiment>-<sweep folder>
    assert [r["name"] for r in runs] == ["rlvr-0", "rlvr-1"]
    assert [r["config"]["algo"]["lr"] for r in runs] == [1e-3, 3e-3]
    assert all(r["config"]["tracking"]["group"] == "rlvr-sweep" for r in runs)  # config.yaml says it too


def test_sweep_group_keeps_the_date_of_hydras_default_folders() -> None:
    from roll_core.sweep import sweep_group

    assert sweep_group("rlvr", "multirun/2026-12-03/21-44-00") == "rlvr-2026-12-03_21-44-00"
    assert sweep_group("lr_scan", "/data/sweeps/lr") == "lr_scan-lr"


def test_without_wandb_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_core.errors import MissingExtraError

    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingExtraError) as err:
        Tracker(tmp_path, "experiment: demo\n", ["tensorboard", "wandb"])
    assert str(err.value) == "pipeline.trackers=[wandb] needs wandb: pip install 'roll-core[wandb]'"


def test_a_resume_after_an_attempt_without_wandb_replays_the_steps_it_missed(tmp_path: Path) -> None:
    """Steps 0-2 with wandb, 3-5 without it (trackers=[]), then wandb again: the continued W&B run holds 0-7 (it
    lacked 3-5)."""
    cfg = yaml.safe_dump({"experiment": "gap", "tracking": {"wandb": {"mode": "offline", "project": "gap"}}})
    for trackers, steps in ((["wandb"], range(3)), ([], range(3, 6)), (["wandb"], range(6, 8))):
        tracker = Tracker(tmp_path, cfg, trackers, resume=steps.start > 0)
        if steps.start:
            tracker.truncate(steps.start - 1)
        for step in steps:
            tracker.log(step, {"loss": float(step)})
        tracker.close()
    shown: dict[int, float] = {}
    for run in _current(tmp_path):
        shown.update({s: m["loss"] for s, m in run["history"].items() if "loss" in m})
    assert shown == {s: float(s) for s in range(8)}


def test_credentials_in_the_config_stay_out_of_the_wandb_config(tmp_path: Path) -> None:
    config = {
        "experiment": "secrets",
        "tracking": {"wandb": {"mode": "offline", "project": "secrets"}, "mlflow": {"tracking_uri": "https://u:t@h"}},
        "env": {"reward": {"headers": {"X-API-Key": "key-123"}, "url": "https://alice:s3cr3t@judge.example/v1"}},
        "judge": {"api_key": "sk-1", "client_secret": "c", "password": "p", "max_tokens": 8},
    }
    tracker = Tracker(tmp_path, yaml.safe_dump(config), ["wandb"])
    tracker.log(0, {"loss": 1.0})
    tracker.close()
    shown = _current(tmp_path)[0]["config"]
    assert shown["tracking"]["mlflow"] == {"tracking_uri": "https://***@h"}
    assert shown["env"]["reward"] == {"headers": {"X-API-Key": "***"}, "url": "https://***@judge.example/v1"}
    assert shown["judge"] == {"api_key": "***", "client_secret": "***", "password": "***", "max_tokens": 8}


def test_a_resume_while_wandb_is_away_goes_on_and_sends_its_steps_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A resumed run (a preemption, a restart after a fault) whose W&B server did not answer ended at once:
    `wandb.init(id=..., resume="allow")` raised CommError ("Failed to get resume status") out of `truncate`. It goes
    on with a warning; once W&B answers (here at close's last try) the W&B run continues and gets the steps it
    lacks from metrics.jsonl."""
    import logging
    import socket

    wandb = pytest.importorskip("wandb", reason="the roll-core[wandb] extra")
    offline = yaml.safe_dump({"experiment": "away", "tracking": {"wandb": {"mode": "offline", "project": "away"}}})
    first = Tracker(tmp_path, offline, ["wandb"])
    for step in range(3):
        first.log(step, {"loss": float(step)})
    first.close()
    wandb.teardown()  # a new W&B session reads the variables below (a session keeps those it started with)
    with socket.socket() as s:  # a port nothing listens on: W&B's server is away
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "1")
    online = yaml.safe_dump({"experiment": "away", "tracking": {"wandb": {"mode": "online", "project": "away"}}})
    try:
        resumed = Tracker(tmp_path, online, ["wandb"], resume=True)
        with caplog.at_level(logging.WARNING, logger="roll_core.trackers.wandb"):
            resumed.truncate(2)  # no exception: training goes on
            began = time.monotonic()
            resumed.log(3, {"loss": 30.0})
            resumed.samples(3, [{"prompt": "p", "response": "r", "reward": 1.0}])
            resumed.log(4, {"loss": 40.0})
            assert time.monotonic() - began < 1.0  # not tried again before the retry interval
        # One warning for the outage (other records of this logger, if any, are not about it).
        records = [r for r in caplog.records if r.name == "roll_core.trackers.wandb"]
        outage = [r for r in records if r.getMessage().startswith("W&B did not answer")]
        assert len(outage) == 1, [r.getMessage()[:200] for r in records]
        assert outage[0].levelno == logging.WARNING and "goes on without it" in outage[0].getMessage()
        resumed.backends[0].mode = "offline"  # W&B answers again (offline files: what this test can read back)
        resumed.close()  # one more try: the W&B run continues and gets steps 3 and 4 from the run folder
    finally:
        wandb.teardown()  # the next test's session reads its own variables
    shown: dict[int, float] = {}
    tables: dict[int, Any] = {}
    for run in _current(tmp_path):
        shown.update({s: m["loss"] for s, m in run["history"].items() if "loss" in m})
        tables.update(run["tables"])
    assert shown == {0: 0.0, 1: 1.0, 2: 2.0, 3: 30.0, 4: 40.0}
    assert tables == {3: [{"step": 3, "prompt": "p", "response": "r", "reward": 1.0}]}
    assert len({run["id"] for run in _current(tmp_path)}) == 1  # the same W&B run, continued


def _exit_code(run_dir: Path) -> int:
    """The exit code of the one offline W&B run under `run_dir` (its `exit` record): what W&B shows as its state."""
    (file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    (code,) = [r.exit.exit_code for r in _finished(file) if r.WhichOneof("record_type") == "exit"]
    return code


def test_a_run_closed_while_its_exception_propagates_is_a_failed_wandb_run(tmp_path: Path) -> None:
    """A failed run's W&B run was finished with exit code 0: W&B showed it `finished`, like a run that trained every
    step. Closed while the run's exception propagates (the loop's failure path, `shutdown` in a `finally`), it
    finishes with exit code 1 (`failed`); a run that ended normally keeps 0."""
    pytest.importorskip("wandb", reason="the roll-core[wandb] extra")
    cfg = yaml.safe_dump({"experiment": "ends", "tracking": {"wandb": {"mode": "offline", "project": "ends"}}})
    failed = Tracker(tmp_path / "failed", cfg, ["wandb"])
    failed.log(1, {"loss": 1.0})
    with pytest.raises(RuntimeError, match="engine died"):
        try:
            raise RuntimeError("engine died")
        finally:
            failed.close()
    ok = Tracker(tmp_path / "ok", cfg, ["wandb"])
    ok.log(1, {"loss": 1.0})
    ok.close()
    # A run that ended well inside its caller's `except` (a retry), told so, is not failed: sys.exc_info made it so.
    retry = Tracker(tmp_path / "retry", cfg, ["wandb"])
    retry.log(1, {"loss": 1.0})
    try:
        raise RuntimeError("the first attempt failed")
    except RuntimeError:
        retry.close(failed=False)
    assert [_exit_code(tmp_path / name) for name in ("failed", "ok", "retry")] == [1, 0, 0]


def test_a_metric_named_as_wandbs_own_keys_is_renamed_not_lost(tmp_path: Path) -> None:
    """W&B dropped a metric named `_step` or "" and overwrote `_runtime` with its own, without a word: the run's
    W&B charts lacked them. Each is logged under another name (a suffix), as is one named as the sample table;
    metrics.jsonl keeps the keys as given."""
    cfg = yaml.safe_dump({"experiment": "names", "tracking": {"wandb": {"mode": "offline"}}})
    metrics = {"_step": 7.0, "_runtime": 8.0, "": 9.0, "samples": 10.0, "_other": 11.0, "loss": 12.0}
    tracker = Tracker(tmp_path, cfg, ["wandb"])
    tracker.log(1, metrics)
    tracker.close()
    assert len(_current(tmp_path)) == 1
    shown = {}
    for record in _finished(next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            shown.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    assert shown["_step"] == 1 and shown["_other"] == 11.0 and shown["loss"] == 12.0 and shown["_"] == 9.0
    for key in ("_step", "_runtime", "samples"):
        (name,) = [k for k in shown if k.startswith(f"{key}-")]
        assert shown[name] == metrics[key]
    assert Tracker.read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, **metrics}]


class _Killed(BaseException):
    """The process killed (a preemption, an OOM kill) at a point of the hand-over of a step to W&B."""


class _KilledAtLog:
    """A W&B run whose `log` of step `at` is cut by a kill: just after W&B got it, or just before."""

    def __init__(self, run: Any, at: int, after: bool) -> None:
        self._run, self._at, self._after = run, at, after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)

    def log(self, data: dict[str, Any], step: int) -> None:
        if step == self._at and not self._after:
            raise _Killed
        self._run.log(data, step=step)
        if step == self._at:
            raise _Killed


@pytest.mark.parametrize("after", [True, False], ids=["after-wandb-got-it", "before-wandb-got-it"])
def test_a_kill_while_a_step_goes_to_wandb_never_leaves_a_stale_or_missing_step(tmp_path: Path, after: bool) -> None:
    """roll-run.json was updated after `run.log` handed the step to W&B: a kill between the two left it a step
    behind W&B, so the resume (its checkpoint the step before) continued the same W&B run and redid a step that W&B
    already held (W&B drops a step below its current one, or merges it into the stale row): step 3 kept the killed
    attempt's value. The record is updated before the step is handed over: a kill in between makes the record say
    W&B may hold the step, and the resume starts a new W&B run replaying steps 0..2 (a step recorded but never
    sent costs a new W&B run, never a stale or a missing value)."""
    pytest.importorskip("wandb", reason="the roll-core[wandb] extra")
    cfg = yaml.safe_dump({"experiment": "kill", "tracking": {"wandb": {"mode": "offline", "project": "kill"}}})
    first = Tracker(tmp_path, cfg, ["wandb"])
    for step in range(3):
        first.log(step, {"loss": float(step)})
    backend = first.backends[0]
    backend.run = _KilledAtLog(backend.run, at=3, after=after)  # type: ignore[attr-defined]
    with pytest.raises(_Killed):
        first.log(3, {"loss": 3.0})
    first.close(failed=True)  # (W&B's service writes what it got: read back below)
    old_id = json.loads((tmp_path / "wandb" / "roll-run.json").read_text())["id"]

    resumed = Tracker(tmp_path, cfg, ["wandb"], resume=True)
    resumed.truncate(2)  # the checkpoint was at step 2: step 3 is redone, with another value
    resumed.log(3, {"loss": 30.0})
    resumed.log(4, {"loss": 40.0})
    resumed.close()
    points = sorted((s, m["loss"]) for run in _current(tmp_path) for s, m in run["history"].items() if "loss" in m)
    assert points == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]  # each step once, the redone value
    (current,) = _current(tmp_path)  # a new W&B run, from the resumed one
    assert current["id"] != old_id and current["config"]["roll_resumed_from"] == old_id
