"""`pipeline.trackers=[mlflow]`: an MLflow run per roll run (the `roll-core[mlflow]` extra).

Options: `tracking.mlflow` (roll_core.config.tracking.MlflowConfig).
- Where: `tracking.mlflow.tracking_uri`, else MLFLOW_TRACKING_URI, else a SQLite store in the run folder
  (`sqlite:///<run>/mlflow/mlflow.db`, artifacts in `<run>/mlflow/artifacts`; view it with
  `mlflow ui --backend-store-uri sqlite:///<run>/mlflow/mlflow.db`).
- Experiment: `tracking.mlflow.experiment`, else `tracking.group` (a sweep's jobs share one), else `experiment`.
  The run's name is the run name (`tracking.run_name`, else `experiment`).
- Params: the resolved config flattened to dotted keys (`algo.lr`; lists as JSON text). MLflow caps a param value
  at 6000 characters: a longer one is cut and ends with PARAM_CUT_NOTE; the whole config is always the run's
  `config.yaml` artifact.
- Metrics: at their step, keys as logged (`reward/mean`; a character MLflow refuses becomes `_`; two keys that
  would then read the same, `a/b=c` and `a/b_c`, stay distinct: the later one is named with a suffix and a warning,
  roll_core.trackers.mlflow_keys.KeyNames).
- Samples: one table artifact per step, `samples/step_000002.json` (MLflow's table format, `{"columns", "data"}`,
  listed in the run's `mlflow.loggedArtifacts` tag as `mlflow.log_table` does, so the UI shows it as a table; the
  tag lists the newest tables that fit MLflow's 8000-character tag value, ~150 steps: older ones stay artifacts).

Secrets (roll_core.tracking.redact_config): params and the config.yaml artifact have credentials redacted (keys such
as `*token`, `*api_key`, `*secret`, `*password`, headers such as `X-API-Key`, and the `user:token@` of URLs, the
tracking URI's included); run.json and messages show the tracking URI without its userinfo. The run folder's own
config.yaml is left as it is.

Resume. `<run>/mlflow/run.json` records the tracking URI (without userinfo), the MLflow run id and the last step
logged to it. MLflow cannot delete metric points (a point logged again at the same step is a second point, not a
replacement), so `truncate(last_step)` does one of two things:
- the MLflow run holds nothing after `last_step` (a preemption right after a checkpoint): the same run continues;
- it holds later steps (a crash between checkpoints; the run redoes them with other values): a new MLflow run
  (same experiment and name, tag `roll.resumed_from=<old id>`) replays steps 0..last_step from the run folder's
  metrics.jsonl and samples.jsonl, then continues; the old run gets tag `roll.superseded_by=<new id>` and is
  moved to MLflow's deleted runs (kept, and restorable with `mlflow runs restore --run-id <id>`).
Either way the MLflow run that run.json names shows exactly the history of metrics.jsonl: a continued run is sent
the steps up to `last_step` it lacks (an attempt that ran without mlflow, or died with points not yet sent: run.json
counts only the steps the server acknowledged or unsent.json keeps).

Network failures. The tracking server is needed when a new run starts (a wrong URI fails there, with its message).
After that, every call to the server runs off the training thread, in order (roll_core.trackers.background):
`log`, `samples` and `truncate` return at once whatever the server does, `close()` waits for what is queued, and
`wait()` waits for the queued calls; an error a queued call raises (a refusal, below) is raised by the next call.
A resumed run (a preemption, or a restart after a fault) whose server does not answer goes on without it: a warning
says so, and the MLflow run is opened (continued or replaced, as above) at a later log once the server answers, then
sent the steps it lacks from metrics.jsonl; `close()` tries once more, and a later resume sends what is still
missing. Later, a send that fails for a network reason (connection refused, timeout, a 5xx) never raises into
training: the points stay buffered, in order, and are sent with the next log once `retry_interval_s` has passed
(doubling to 5 minutes while the server stays away); every failed send is counted in the metric FAILURES_METRIC
(logged with the data once the server is back) and warned about once per outage. The buffer is bounded: past
`tracking.mlflow.max_buffered_points` metric points (or MAX_BUFFERED_TABLES sample tables) the oldest are dropped,
counted in DROPPED_METRIC and warned about once per outage and again, with the total, when the server answers or the
run ends (they stay in the run folder's metrics.jsonl and samples.jsonl; MLflow lacks them). `close()` tries once
more; what still cannot be sent is written to `<run>/mlflow/unsent.json` (an error names it) and sent when the run
resumes in the same folder. A refusal that is not a network problem (an invalid value) raises: resending would not help.
MLflow's own HTTP retries are bounded by `tracking.mlflow.timeout_s` and `tracking.mlflow.retries` (unless the
MLFLOW_HTTP_REQUEST_* environment variables say otherwise); while the server is away, a resend is one request: an
outage is noticed within about `(retries + 1) * timeout_s`, and `close()` waits about `timeout_s` per request it
still makes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from roll_core.config.tracking import MLFLOW, backend_options, tracking_config
from roll_core.trackers.background import SerialWorker
from roll_core.trackers.mlflow_buffer import LOGGED_ARTIFACTS_TAG, Dropped, drop_oldest, table, tables_tag
from roll_core.trackers.mlflow_keys import (
    MAX_KEY,
    MAX_PARAM_VALUE,
    PARAM_CUT_NOTE,
    KeyNames,
    flatten_config,
    mlflow_key,
)
from roll_core.trackers.replay import kept_metrics, kept_samples
from roll_core.tracking import redact_config, redact_exception, redact_text

__all__ = [
    "DROPPED_METRIC",
    "FAILURES_METRIC",
    "MAX_KEY",
    "MAX_PARAM_VALUE",
    "PARAM_CUT_NOTE",
    "KeyNames",
    "MlflowTracker",
    "flatten_config",
    "mlflow_key",
    "read_run",
]

log = logging.getLogger(__name__)
#: The run folder's record of its MLflow run: {"tracking_uri", "run_id", "last_step"}.
STATE_FILE = "run.json"
#: What could not be sent by `close()`: sent when the run resumes.
UNSENT_FILE = "unsent.json"
#: Metric counting the failed sends of this run (logged once the server answers again).
FAILURES_METRIC = "tracking/mlflow_send_failures"
#: Metric counting the buffered points this run dropped (the buffer full while the server was away).
DROPPED_METRIC = "tracking/mlflow_dropped_points"
#: Sample tables buffered while the server is away (each up to `samples_per_step` rows of `sample_max_chars`).
MAX_BUFFERED_TABLES = 100
# MLflow's limits (mlflow.utils.validation) on entities per log_batch call (names and values: mlflow_keys).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
# MLflow error codes that mean "this request is wrong", not "the server is away": resending would not help.
PERMANENT_ERRORS = frozenset(
    {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "PERMISSION_DENIED"}
)
MAX_RETRY_INTERVAL_S = 300.0
#: MLflow's own HTTP settings are process-wide variables (`MlflowTracker._http`): one tracker sets them at a time.
_HTTP_SETTINGS = threading.RLock()


def is_network_error(exc: BaseException) -> bool:
    """Whether a failed MLflow call may succeed when sent again (the server was unreachable, timed out or failed
    with a 5xx), as opposed to a request MLflow refuses."""
    code = getattr(exc, "error_code", None)
    return code not in PERMANENT_ERRORS


class Unreachable(RuntimeError):
    """The tracking server did not answer (`is_network_error`) when the MLflow run was to be started or reopened."""


class MlflowTracker:
    """An MLflow run (see the module docstring for the store, resume and network failures)."""

    extra = MLFLOW

    def __init__(self, *, run_dir: Path, config: dict[str, Any], name: str, resume: bool) -> None:
        MLFLOW.require()
        from mlflow.tracking import MlflowClient

        self.options = backend_options(config, "mlflow")
        self.config, self.name = config, name
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "mlflow"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.uri = self.options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or self._local_uri()
        self.shown_uri = redact_text(self.uri)  # what run.json and messages hold: no `user:token@`
        self.experiment = (
            self.options.experiment or tracking_config(config).group or str(config.get("experiment") or name)
        )
        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id: str | None = None
        self.last_step = -1  # the last step logged to the current MLflow run (sent or buffered)
        # The last step the server holds, or unsent.json keeps for the next attempt: what run.json records, so a
        # process that dies with points only in memory has them replayed from metrics.jsonl when it resumes.
        self.held_step = -1
        # The buffer: what is not yet accepted by the server, in the order it was logged.
        self.pending_params: dict[str, str] = {}
        self.pending_tags: dict[str, str] = {}
        self.pending_metrics: list[tuple[str, float, int, int]] = []  # key, value, timestamp ms, step
        self.pending_artifacts: dict[str, str] = {}  # artifact path -> text
        self.tables: list[dict[str, str]] = []  # the run's table artifacts (LOGGED_ARTIFACTS_TAG)
        self.keys = KeyNames("metric", reserved=[FAILURES_METRIC, DROPPED_METRIC])  # MLflow names, distinct
        self.failures = 0  # failed sends of this run (FAILURES_METRIC)
        self.outage_failures = 0  # failed sends since the last success
        self.retry_at = 0.0
        self.dropped = 0  # metric points dropped from the full buffer (DROPPED_METRIC)
        self.outage_dropped = Dropped()  # what this outage dropped (its warnings)
        self._reported = [0, 0]  # the failures and dropped counts last buffered as metrics
        # A resumed run whose MLflow run is not open yet: the recorded run is valid up to this step (`_open`).
        self.resume_step: int | None = None
        self.seen_step = -1  # the last step given to this backend while its run is not open
        # MLflow's SQL store uses what SQLAlchemy 2.1 deprecates: notices a user can do nothing about, kept out of
        # the run's log. A filter for good (set here, on the caller's thread): `catch_warnings` around each call, on
        # the worker thread, would race the training thread's own filters.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"mlflow\.store\.")
        if not resume:
            self._start()
        # On resume, the first truncate (or log) decides: continue the recorded run or start a new one.
        # Only the worker touches the state above from here on (the module docstring: network failures).
        self._worker: SerialWorker | None = SerialWorker(f"roll-mlflow-{name}")

    # ---- the MLflow side -------------------------------------------------------------------------------------
    def _local_uri(self) -> str:
        return f"sqlite:///{(self.dir / 'mlflow.db').resolve()}"

    @contextmanager
    def _http(self) -> Iterator[None]:
        """Around every MLflow call: bound MLflow's own HTTP retries (its defaults retry for minutes; variables the
        user set are left alone). MLflow reads them from the environment, so they are set for the call, one tracker
        at a time. While the server is known to be away (a failed call since the last success), a call is one
        request: the buffer's own schedule tries again (MLflow's retries of a hung server took `retries + 1` times
        `timeout_s`, ~47 s by default, at every resend)."""
        settings = {
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(self.options.timeout_s))),
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(0 if self.outage_failures else self.options.retries),
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        }
        with _HTTP_SETTINGS:
            added = [k for k in settings if k not in os.environ]
            os.environ.update({k: settings[k] for k in added})
            try:
                yield
            finally:
                for k in added:
                    os.environ.pop(k, None)

    def _experiment_id(self) -> str:
        """The experiment's id, created when missing (a local store keeps its artifacts in the run folder)."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            local = not self.uri.startswith(("http://", "https://", "databricks"))
            location = (self.dir / "artifacts").resolve().as_uri() if local else None
            try:
                return self.client.create_experiment(self.experiment, artifact_location=location)
            except MlflowException:  # another job of the sweep created it meanwhile
                found = self.client.get_experiment_by_name(self.experiment)
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            log.warning("MLflow experiment %r was deleted: restoring it for this run", self.experiment)
            self.client.restore_experiment(found.experiment_id)
        return str(found.experiment_id)

    def _start(self, *, resumed_from: str | None = None) -> None:
        """Create the MLflow run (the server must answer: a wrong URI fails here, before training)."""
        tags = {**self.options.tags, "roll.run_dir": str(self.run_dir.resolve())}
        if resumed_from is not None:
            tags["roll.resumed_from"] = resumed_from
        try:
            with self._http():
                run = self.client.create_run(self._experiment_id(), run_name=self.name, tags=tags)
        except Exception as exc:
            error = Unreachable if is_network_error(exc) else RuntimeError
            message = f"MLflow at {self.shown_uri}: cannot start the run ({redact_text(str(exc))})"
            raise error(message) from redact_exception(exc)  # MLflow's message names the URI with its userinfo
        self.run_id, self.last_step, self.held_step, self.tables = run.info.run_id, -1, -1, []
        self.pending_params = flatten_config(redact_config(self.config))
        self.pending_artifacts["config.yaml"] = self._config_text()
        self._save_state()
        self._flush(final=True)

    def _config_text(self) -> str:
        """The config.yaml artifact: the run folder's file (else the config), credentials redacted."""
        from omegaconf import OmegaConf

        config_file = self.run_dir / "config.yaml"
        text = config_file.read_text() if config_file.exists() else None
        config = OmegaConf.to_container(OmegaConf.create(text)) if text is not None else self.config
        redacted = redact_config(config)
        if text is not None and redacted == config:
            return text  # nothing to hide: the file as it is
        return OmegaConf.to_yaml(OmegaConf.create(redacted))

    def _continue(self, run_id: str) -> bool:
        """Continue the recorded run; False when the store no longer has it (deleted or another store)."""
        try:
            with self._http():
                run = self.client.get_run(run_id)
        except Exception as exc:
            if is_network_error(exc):
                raise Unreachable(
                    f"MLflow at {self.shown_uri}: cannot reach the run {run_id} ({redact_text(str(exc))})"
                ) from redact_exception(exc)
            return False
        if run.info.lifecycle_stage == "deleted":
            return False
        self.run_id = run_id
        try:
            self.tables = list(json.loads(run.data.tags.get(LOGGED_ARTIFACTS_TAG, "[]")))
        except ValueError:  # a tag MLflow cut at its length limit (a run logged before `tables_tag`)
            self.tables = []
        # Params cannot change in MLflow: a resumed run with another config keeps the first values (config.yaml,
        # logged again, is the resumed run's).
        new = flatten_config(redact_config(self.config))
        changed = sorted(k for k, v in new.items() if k in run.data.params and run.data.params[k] != v)
        if changed:
            log.warning("MLflow params keep their first values; changed on resume: %s", ", ".join(changed[:10]))
        self.pending_params = {k: v for k, v in new.items() if k not in run.data.params}
        self.pending_artifacts["config.yaml"] = self._config_text()
        self._load_unsent()
        return True

    def _supersede(self, old: str, new: str) -> None:
        """Tag the abandoned run and move it to MLflow's deleted runs (restorable); a failure only warns."""
        try:
            with self._http():
                self.client.set_tag(old, "roll.superseded_by", new)
                self.client.set_terminated(old, "KILLED")
                self.client.delete_run(old)
        except Exception as exc:  # the new run is complete without this: never fail the resume for it
            log.warning("MLflow: could not mark the superseded run %s (%s)", old, redact_text(str(exc)))

    def _replay(self, last_step: int, after: int = -1) -> None:
        """Log what the run folder's own files hold of the steps in (`after`, `last_step`] into the run."""
        samples = kept_samples(self.run_dir, last_step, after)
        for step, metrics in kept_metrics(self.run_dir, last_step, after):
            self._add_metrics(step, metrics)
        for step, rows in sorted(samples.items()):
            self._add_samples(step, rows)
        self._flush(final=True)

    # ---- state and buffer files ------------------------------------------------------------------------------
    def _save_state(self) -> None:
        state = {"tracking_uri": self.shown_uri, "run_id": self.run_id, "last_step": self.held_step}
        tmp = self.dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.dir / STATE_FILE)  # a crash mid-write keeps the previous record

    def _pending(self) -> bool:
        return bool(self.pending_params or self.pending_tags or self.pending_metrics or self.pending_artifacts)

    def _save_unsent(self) -> None:
        unsent = {
            "run_id": self.run_id,
            "params": self.pending_params,
            "tags": self.pending_tags,
            "metrics": self.pending_metrics,
            "artifacts": self.pending_artifacts,
        }
        tmp = self.dir / (UNSENT_FILE + ".tmp")
        tmp.write_text(json.dumps(unsent))
        tmp.replace(self.dir / UNSENT_FILE)
        self.held_step = self.last_step  # kept for the next attempt
        self._save_state()

    def _load_unsent(self) -> None:
        path = self.dir / UNSENT_FILE
        if not path.exists():
            return
        unsent = json.loads(path.read_text())
        if unsent.get("run_id") != self.run_id:
            return
        self.pending_params = {**unsent["params"], **self.pending_params}
        self.pending_tags = {**unsent["tags"], **self.pending_tags}
        self.pending_metrics = [tuple(m) for m in unsent["metrics"]] + self.pending_metrics  # type: ignore[misc]
        self.pending_artifacts = {**unsent["artifacts"], **self.pending_artifacts}
        log.info("MLflow: %d metric points of an earlier attempt are sent now", len(unsent["metrics"]))

    # ---- sending ---------------------------------------------------------------------------------------------
    def _send(self) -> None:
        """Send the buffer; each part leaves it once the server accepted it (a failure keeps the rest)."""
        from mlflow.entities import Metric, Param, RunTag

        assert self.run_id is not None
        while self.pending_params:
            chunk = list(self.pending_params.items())[:MAX_PARAMS_TAGS_PER_BATCH]
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])
            for k, _ in chunk:
                del self.pending_params[k]
        while self.pending_tags:
            chunk = list(self.pending_tags.items())[:MAX_PARAMS_TAGS_PER_BATCH]
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in chunk])
            for k, _ in chunk:
                del self.pending_tags[k]
        while self.pending_metrics:
            chunk = self.pending_metrics[:MAX_METRICS_PER_BATCH]
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in chunk])
            del self.pending_metrics[: len(chunk)]
        while self.pending_artifacts:
            path, text = next(iter(self.pending_artifacts.items()))
            self.client.log_text(self.run_id, text, path)
            del self.pending_artifacts[path]

    def _flush(self, *, final: bool = False) -> bool:
        """Send what is buffered unless a recent failure says to wait (`final`: try now); True when all is sent."""
        if not self._pending() or (not final and time.monotonic() < self.retry_at):
            return not self._pending()
        try:
            with self._http():
                self._send()
        except Exception as exc:
            if not is_network_error(exc):
                raise
            self._outage(exc, f"{len(self.pending_metrics)} metric points buffered, resent")
            return False
        if self.outage_failures:
            log.warning("MLflow at %s answers again: the buffered points are sent", self.shown_uri)
            self.outage_failures, self.retry_at = 0, 0.0
            self._dropped_summary(log.warning)
        (self.dir / UNSENT_FILE).unlink(missing_ok=True)
        if self.held_step != self.last_step:
            self.held_step = self.last_step
            self._save_state()
        return True

    def _outage(self, exc: BaseException, waiting: str) -> None:
        """Count a failed call, set when to try again (`retry_interval_s`, doubling up to MAX_RETRY_INTERVAL_S) and
        warn once per outage: "`waiting` after N s"."""
        self.failures += 1
        self.outage_failures += 1
        wait = min(self.options.retry_interval_s * 2 ** (self.outage_failures - 1), MAX_RETRY_INTERVAL_S)
        self.retry_at = time.monotonic() + wait
        if self.outage_failures == 1:
            cause = exc.__cause__ if isinstance(exc, Unreachable) and exc.__cause__ is not None else exc
            reason = redact_text(str(cause).splitlines()[0])[:300]
            log.warning(
                "MLflow at %s is not answering (%s): %s after %.0f s; training goes on",
                self.shown_uri,
                reason,
                waiting,
                wait,
            )

    def _bound_buffer(self) -> None:
        """Past `max_buffered_points` points or MAX_BUFFERED_TABLES tables, drop the oldest (mlflow_buffer):
        counted (DROPPED_METRIC) and warned once per outage; the run folder's files keep them."""
        first, (points, tables) = not self.outage_dropped, (self.outage_dropped.points, self.outage_dropped.tables)
        limits = (self.options.max_buffered_points, MAX_BUFFERED_TABLES)
        if not drop_oldest(self.pending_metrics, self.pending_artifacts, self.tables, *limits, self.outage_dropped):
            return
        self.dropped += self.outage_dropped.points - points
        if self.outage_dropped.tables != tables:  # the UI's list names only the tables the run has
            self.pending_tags[LOGGED_ARTIFACTS_TAG] = tables_tag(self.tables)
        if first:
            log.warning(
                "MLflow at %s is still away and the buffer is full (tracking.mlflow.max_buffered_points=%d, %d sample "
                "tables): the oldest are dropped, counted in %s; %s keeps every step",
                *(self.shown_uri, *limits, DROPPED_METRIC, self.run_dir / "metrics.jsonl"),
            )

    def _dropped_summary(self, say: Any) -> None:
        """Say (a logging call) what this outage dropped, if anything, then start counting anew."""
        d, self.outage_dropped = self.outage_dropped, Dropped()
        if d:
            say(
                "MLflow: %d metric points (steps %d to %d) and %d sample tables logged while the server was away were "
                "dropped (buffer full): MLflow lacks them; %s and samples.jsonl keep them",
                *(d.points, d.first_step, d.last_step, d.tables, self.run_dir / "metrics.jsonl"),
            )

    def _counts(self, step: int) -> None:
        """Buffer FAILURES_METRIC and DROPPED_METRIC at `step` where they changed (sent with the data)."""
        for key, count, reported in ((FAILURES_METRIC, self.failures, 0), (DROPPED_METRIC, self.dropped, 1)):
            if count != self._reported[reported]:
                self.pending_metrics.append((key, float(count), self._timestamp(), step))
                self._reported[reported] = count

    def _timestamp(self) -> int:
        return int(time.time() * 1000)

    def _add_metrics(self, step: int, metrics: dict[str, float]) -> None:
        ts = self._timestamp()
        names = self.keys.names_of(metrics)
        for key, value in metrics.items():
            self.pending_metrics.append((names[key], float(value), ts, step))
        self.last_step = max(self.last_step, step)

    def _add_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        path = f"samples/step_{step:06d}.json"
        self.pending_artifacts[path] = json.dumps(table(step, rows), ensure_ascii=False)
        entry = {"path": path, "type": "table"}
        if entry not in self.tables:
            self.tables.append(entry)
            self.pending_tags[LOGGED_ARTIFACTS_TAG] = tables_tag(self.tables)
        self.last_step = max(self.last_step, step)

    # ---- the TrackerBackend calls: queued for the worker (the module docstring: network failures) ---------------
    def _submit(self, call: Any, *args: Any) -> None:
        if self._worker is None:
            raise RuntimeError("MlflowTracker used after close()")
        self._worker.submit(call, *args)

    def truncate(self, last_step: int) -> None:
        """Queue `_truncate(last_step)`."""
        self._submit(self._truncate, last_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Queue `_log(step, metrics)` (a copy: the caller may reuse the dict)."""
        self._submit(self._log, step, dict(metrics))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Queue `_samples(step, rows)` (copies)."""
        if self.options.log_samples and rows:
            self._submit(self._samples, step, [dict(row) for row in rows])

    def wait(self) -> None:
        """Block until the calls made so far are done (the server accepted them, or they are buffered); raise the
        error one of them raised."""
        if self._worker is not None:
            self._worker.wait()

    def close(self) -> None:
        """Run `_close` after the queued calls (FAILED when closed while an exception propagates) and stop the
        worker; raise the first error of a queued call or of `_close` (idempotent)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.finish(self._close, sys.exc_info()[0] is not None)

    # ---- what the worker runs --------------------------------------------------------------------------------
    def _truncate(self, last_step: int) -> None:
        """Continue the recorded run when it holds nothing after `last_step`, else start a new one replaying steps
        0..last_step (MLflow cannot delete points; see the module docstring). A server that does not answer is
        warned about, and the run is opened at a later log."""
        if self.run_id is not None:
            if self.last_step <= last_step:
                self.pending_metrics = [m for m in self.pending_metrics if m[3] <= last_step]
                return
            old = self.run_id
            self.pending_metrics, self.pending_artifacts, self.pending_tags = [], {}, {}
            self._start(resumed_from=old)
            self._supersede(old, str(self.run_id))
            self._replay(last_step)
            return
        self.resume_step = last_step if self.resume_step is None else min(self.resume_step, last_step)
        self.seen_step = last_step
        self._open(last_step)

    def _open(self, upto: int) -> bool:
        """Open a resumed run's MLflow run: the recorded one when it holds nothing after `resume_step`, else a new
        one; then send it the steps up to `upto` it lacks, from the run folder's files. False (counted, warned once)
        when the server does not answer: the steps wait in metrics.jsonl, and a log after `retry_at` tries again."""
        assert self.resume_step is not None
        path = self.dir / STATE_FILE
        state = json.loads(path.read_text()) if path.exists() else None
        # run.json holds the URI without userinfo (one written before that: with it)
        same_store = state is not None and state.get("tracking_uri") in (self.shown_uri, self.uri)
        try:
            if same_store and int(state["last_step"]) <= self.resume_step and self._continue(str(state["run_id"])):
                self.resume_step = None
                self.last_step = self.held_step = int(state["last_step"])
                self._save_state()
                for _, metrics in kept_metrics(self.run_dir, self.held_step):  # the names its keys have there
                    self.keys.names_of(metrics)
                # the steps it lacks: an attempt that ran without this tracker, or died with its points unsent
                self._replay(upto, after=self.held_step)
                return True
            self._start(resumed_from=str(state["run_id"]) if same_store else None)
        except Unreachable as exc:
            self._outage(exc, "this resumed run's MLflow run is opened, and sent its steps from metrics.jsonl,")
            return False
        self.resume_step = None
        if same_store:
            self._supersede(str(state["run_id"]), str(self.run_id))
        self._replay(upto)
        return True

    def _ensure_run(self, step: int) -> bool:
        """Whether the MLflow run is open to log `step`; a resumed run's is opened here when `truncate` did not
        (it was not called, or the server did not answer: tried again once `retry_at` has passed)."""
        if self.run_id is not None:
            return True
        if self.resume_step is None:  # a resumed run logged without truncating first: keep what precedes this step
            self.resume_step = step - 1
        self.seen_step = max(self.seen_step, step)
        return time.monotonic() >= self.retry_at and self._open(step - 1)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        """Buffer the metrics at `step` and send the buffer (a network failure keeps it for later)."""
        if not self._ensure_run(step):
            return  # metrics.jsonl holds the step: sent when the MLflow run opens
        self._add_metrics(step, metrics)
        self._counts(step)
        self._save_state()
        if not self._flush():
            self._bound_buffer()

    def _samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Log the rows as the table artifact `samples/step_<step>.json`."""
        if not self._ensure_run(step):
            return  # samples.jsonl holds the rows: sent when the MLflow run opens
        self._add_samples(step, rows)
        self._save_state()
        if not self._flush():
            self._bound_buffer()

    def _close(self, failed: bool) -> None:
        """Send what is buffered and end the run (FAILED when `failed`); what cannot be sent goes to
        `<run>/mlflow/unsent.json` for the next attempt. A resumed run whose MLflow run never opened tries once more
        to open it and send its steps."""
        if self.run_id is None and self.resume_step is not None and not self._open(self.seen_step):
            self.resume_step = None
            log.error(
                "MLflow at %s did not answer: this attempt's steps (up to %d) are not in MLflow; a resume of this run "
                "sends them from metrics.jsonl",
                self.shown_uri,
                self.seen_step,
            )
        if self.run_id is None:
            return
        sent = self._flush(final=True)
        if [self.failures, self.dropped] != self._reported:
            self._counts(self.last_step)  # the counts go with the last data
            sent = sent and self._flush(final=True)
        if sent:
            try:
                with self._http():
                    self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
            except Exception as exc:
                log.warning("MLflow: could not mark run %s as ended (%s)", self.run_id, redact_text(str(exc)))
        else:
            self._save_unsent()
            self._dropped_summary(log.error)
            log.error(
                "MLflow at %s did not answer: %d metric points of run %s are in %s, sent when this run resumes "
                "(metrics.jsonl holds them too)",
                self.shown_uri,
                len(self.pending_metrics),
                self.run_id,
                self.dir / UNSENT_FILE,
            )
        self.run_id = None


def read_run(client: Any, run_id: str) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} of an MLflow run through its client (for a step logged twice, the later point),
    FAILURES_METRIC and DROPPED_METRIC left out: what the run's charts show."""
    run = client.get_run(run_id)
    shown: dict[int, dict[str, tuple[int, float]]] = {}
    for key in run.data.metrics:
        if key in (FAILURES_METRIC, DROPPED_METRIC):
            continue
        for point in client.get_metric_history(run_id, key):
            seen = shown.setdefault(point.step, {}).get(key)
            if seen is None or point.timestamp >= seen[0]:
                shown[point.step][key] = (point.timestamp, point.value)
    return {step: {k: v for k, (_, v) in metrics.items()} for step, metrics in shown.items()}
