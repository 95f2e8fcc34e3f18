"""`pipeline.trackers=[mlflow]`: an MLflow run per roll run (the `roll-core[mlflow]` extra).

Options: `tracking.mlflow` (roll_core.config.tracking.MlflowConfig).
- Where: `tracking.mlflow.tracking_uri`, else MLFLOW_TRACKING_URI, else a SQLite store in the run folder
  (`sqlite:///<run>/mlflow/mlflow.db`, artifacts in `<run>/mlflow/artifacts`; view it with
  `mlflow ui --backend-store-uri sqlite:///<run>/mlflow/mlflow.db`). That store goes with the folder: moved, its
  runs resume (roll_core.trackers.mlflow_resume) and their artifacts are the moved folder's
  (roll_core.trackers.mlflow_local). Another store not behind a server (a `sqlite:` or `file:` URI, a database) keeps
  each run's artifacts in its own run folder, also where a sweep's jobs share it (roll_core.trackers.mlflow_local).
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

Resume (roll_core.trackers.mlflow_resume). `<run>/mlflow/run.json` records the MLflow run and the last step it
holds; `truncate(last_step)` continues that run when it holds nothing after `last_step`, else starts a new one
(tag `roll.resumed_from`) that replays steps 0..last_step from the run folder's files, the old one tagged
`roll.superseded_by` and moved to MLflow's deleted runs. Either way the MLflow run that run.json names shows exactly
the history of metrics.jsonl. A run that starts over in its folder (killed before its first checkpoint, run again)
retires the earlier attempt's run the same way unless it finished.

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
A store on this machine's disk that cannot be written (the run folder's SQLite store or artifacts, a `file:` or
`sqlite:` URI: a read-only folder, a full disk; roll_core.trackers.mlflow_http.local_failure), or the run folder's
record of the run (run.json, unsent.json), is neither: it is said once, as an error naming the error, what is
buffered is dropped, and this
attempt sends MLflow nothing more; training goes on, metrics.jsonl keeps every step, and a resume of the run (once the
store can be written) sends the steps MLflow lacks. (It was taken for an outage: resent for the whole run, with
"not answering" warnings.)
MLflow's own HTTP retries are bounded by `tracking.mlflow.timeout_s` and `tracking.mlflow.retries` (unless the
MLFLOW_HTTP_REQUEST_* environment variables say otherwise; roll_core.trackers.mlflow_http); while the server is away,
a resend is one request: an outage is noticed within about `(retries + 1) * timeout_s`.

Closing is bounded: `close()` returns within `tracking.mlflow.close_timeout_s` (30 s by default) whatever the server
does; what it could not send is said and sent by a resume, and an end the server was not told is retried
(roll_core.trackers.mlflow_close).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from roll_core.config.tracking import MLFLOW, backend_options, tracking_config
from roll_core.trackers.background import SerialWorker
from roll_core.trackers.mlflow_buffer import (
    LOGGED_ARTIFACTS_TAG,
    Backlog,
    Dropped,
    drop_oldest,
    table,
    tables_tag,
)
from roll_core.trackers.mlflow_close import MlflowClose
from roll_core.trackers.mlflow_end import MAX_RETRY_INTERVAL_S
from roll_core.trackers.mlflow_http import CloseDeadline, Unreachable, bounded_http, is_network_error, local_failure
from roll_core.trackers.mlflow_keys import (
    MAX_KEY,
    MAX_PARAM_VALUE,
    PARAM_CUT_NOTE,
    KeyNames,
    flatten_config,
    mlflow_key,
)
from roll_core.trackers.mlflow_local import ROLL_LOCATION_TAG, follow_folder, own_artifacts
from roll_core.trackers.mlflow_resume import STATE_FILE, UNSENT_FILE, MlflowResume
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
#: Metric counting the failed sends of this run (logged once the server answers again).
FAILURES_METRIC = "tracking/mlflow_send_failures"
#: Metric counting the buffered points this run dropped (the buffer full while the server was away).
DROPPED_METRIC = "tracking/mlflow_dropped_points"
#: Sample tables buffered while the server is away (each up to `samples_per_step` rows of `sample_max_chars`).
MAX_BUFFERED_TABLES = 100
# MLflow's limits (mlflow.utils.validation) on entities per log_batch call (names and values: mlflow_keys).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100


class MlflowTracker(MlflowResume, MlflowClose):
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
        # The run folder's own store: the same store wherever the folder is (moved, or under another mount point)
        self.local_store = self.uri == self._local_uri()
        if self.local_store:  # its artifacts follow the folder (MLflow's locations are absolute paths)
            follow_folder(self.dir / "mlflow.db", self.dir / "artifacts")
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
        self.store_failure: str | None = None  # a local store that cannot be written: nothing more is sent (`_broken`)
        self.state_said = False  # a run.json / unsent.json the resume cannot use was warned about (`_recorded`)
        # A resumed run whose MLflow run is not open yet: the recorded run is valid up to this step (`_open`).
        self.resume_step: int | None = None
        self.seen_step = -1  # the last step given to this backend while its run is not open
        # Closing (set by `close()`, read by the worker): the calls to the server end by `_requests_by`; past the
        # whole deadline `close()` gives up on the worker (`_abandon`), which then makes no call and writes nothing.
        self._requests_by: float | None = None
        self._abandoned = False
        # The run's end as `close()` saw it (status, time in ms): told the server, else recorded and delivered later.
        self._end: tuple[str, int] = ("FINISHED", 0)
        self.end_delivery: threading.Thread | None = None  # the delivery of an end the server was not told
        self._backlog = Backlog()  # the queued calls the worker has not begun (counted if `close()` gives up)
        # MLflow's SQL store uses what SQLAlchemy 2.1 deprecates: notices a user can do nothing about, kept out of
        # the run's log. A filter for good (set here, on the caller's thread): `catch_warnings` around each call, on
        # the worker thread, would race the training thread's own filters.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"mlflow\.store\.")
        if not resume:  # (an earlier attempt's unfinished run, named by run.json, is retired: `_start_over`)
            self._start_over()
        # On resume, the first truncate (or log) decides: continue the recorded run or start a new one.
        # Only the worker touches the state above from here on (the module docstring: network failures).
        self._worker: SerialWorker | None = SerialWorker(f"roll-mlflow-{name}")

    # ---- the MLflow side -------------------------------------------------------------------------------------
    def _local_uri(self) -> str:
        return f"sqlite:///{(self.dir / 'mlflow.db').resolve()}"

    @contextmanager
    def _http(self) -> Iterator[None]:
        """Around every MLflow call (roll_core.trackers.mlflow_http.bounded_http): while the server is known to be
        away (a failed call since the last success), a call is one request: the buffer's own schedule tries again
        (MLflow's retries of a hung server took `retries + 1` times `timeout_s`, ~47 s by default, at every resend).
        While closing, a call ends by `_requests_by` or is not made (CloseDeadline)."""
        retries = 0 if self.outage_failures else self.options.retries
        with bounded_http(self.options.timeout_s, retries, self._requests_by):
            yield

    def _experiment_id(self) -> str:
        """The experiment's id, created when missing (a local store keeps its artifacts in the run folder: this one's,
        and in a store other run folders share, each run its own, `own_artifacts`)."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            local = not self.uri.startswith(("http://", "https://", "databricks"))
            location = (self.dir / "artifacts").resolve().as_uri() if local else None
            try:
                # tagged: `own_artifacts` moves only the runs of an experiment roll gave a run folder's location
                tags = {ROLL_LOCATION_TAG: location} if location is not None else None
                return self.client.create_experiment(self.experiment, artifact_location=location, tags=tags)
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
        run = None
        try:
            with self._http():
                run = self.client.create_run(self._experiment_id(), run_name=self.name, tags=tags)
                # a store other run folders share: the experiment's location is the folder of the job that made it
                own_artifacts(self.client, run, self.dir / "artifacts")
        except Exception as exc:
            if run is not None:  # created, but not the run's to use: it stayed RUNNING beside the one a retry makes
                self._end_unused(run.info.run_id)
            error = Unreachable if is_network_error(exc) else RuntimeError
            message = f"MLflow at {self.shown_uri}: cannot start the run ({redact_text(str(exc))})"
            raise error(message) from redact_exception(exc)  # MLflow's message names the URI with its userinfo
        before = (self.run_id, self.last_step, self.held_step, self.tables)
        self.run_id, self.last_step, self.held_step, self.tables = run.info.run_id, -1, -1, []
        try:
            self._save_state()
        except OSError as exc:  # no resume would find the run (run.json names the one before): ended, not used
            self.run_id, self.last_step, self.held_step, self.tables = before
            self._end_unused(run.info.run_id)
            raise RuntimeError(f"MLflow: cannot record the run in {self.dir / STATE_FILE} ({exc})") from exc
        self.pending_params = flatten_config(redact_config(self.config))
        self.pending_artifacts["config.yaml"] = self._config_text()
        self._flush(final=True)

    def _end_unused(self, run_id: str) -> None:
        """End a run `_start` created and cannot use (its artifacts' location or run.json could not be set), best
        effort: KILLED and moved to MLflow's deleted runs (restorable); it holds no data, and left as it was it
        showed RUNNING for good, one more for each retry of the start."""
        try:
            with self._http():
                self.client.set_terminated(run_id, "KILLED")
                self.client.delete_run(run_id)
        except Exception as exc:
            log.warning("MLflow: run %s, created but not used, could not be ended (%s)", run_id, redact_text(str(exc)))

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

    # ---- state and buffer files ------------------------------------------------------------------------------
    def _keep_state(self) -> bool:
        """`_save_state`; False when run.json cannot be written (a full disk, a read-only folder): said once as the
        store's failure is (`_broken`), never raised into training. run.json then names at most what the server
        holds, so a resume sends the steps MLflow lacks."""
        try:
            self._save_state()
        except OSError as exc:
            self._broken(exc)
            return False
        return True

    def _save_state(self) -> None:
        state = {"tracking_uri": self.shown_uri, "run_id": self.run_id, "last_step": self.held_step}
        state["local"] = self.local_store
        tmp = self.dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.dir / STATE_FILE)  # a crash mid-write keeps the previous record

    def _pending(self) -> bool:
        return bool(self.pending_params or self.pending_tags or self.pending_metrics or self.pending_artifacts)

    def _save_unsent(self) -> bool:
        """Keep the buffer in unsent.json for the next attempt (the module docstring); False when it cannot be
        written (said once, `_broken`): run.json then names only what the server holds, and a resume sends the
        rest from metrics.jsonl."""
        unsent = {
            "run_id": self.run_id,
            "params": self.pending_params,
            "tags": self.pending_tags,
            "metrics": self.pending_metrics,
            "artifacts": self.pending_artifacts,
        }
        tmp, held = self.dir / (UNSENT_FILE + ".tmp"), self.held_step
        try:
            tmp.write_text(json.dumps(unsent))
            tmp.replace(self.dir / UNSENT_FILE)
            self.held_step = self.last_step  # kept for the next attempt
            self._save_state()
        except OSError as exc:
            # run.json names only the steps the server holds: unsent.json's points, loaded too, would be sent twice
            self.held_step = held
            try:
                (self.dir / UNSENT_FILE).unlink(missing_ok=True)
            except OSError:
                pass  # (the write failed first: nothing of this attempt's is in it)
            self._broken(exc)
            return False
        return True

    # ---- sending ---------------------------------------------------------------------------------------------
    def _send(self) -> None:
        """Send the buffer; each part leaves it once the server accepted it (a failure keeps the rest)."""
        from mlflow.entities import Metric, Param, RunTag

        assert self.run_id is not None
        # Each request in its own `_http`: while closing, each one's timeout is what is left before the deadline.
        while self.pending_params:
            chunk = list(self.pending_params.items())[:MAX_PARAMS_TAGS_PER_BATCH]
            with self._http():
                self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])
            for k, _ in chunk:
                del self.pending_params[k]
        while self.pending_tags:
            chunk = list(self.pending_tags.items())[:MAX_PARAMS_TAGS_PER_BATCH]
            with self._http():
                self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in chunk])
            for k, _ in chunk:
                del self.pending_tags[k]
        while self.pending_metrics:
            chunk = self.pending_metrics[:MAX_METRICS_PER_BATCH]
            with self._http():
                self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in chunk])
            del self.pending_metrics[: len(chunk)]
        while self.pending_artifacts:
            path, text = next(iter(self.pending_artifacts.items()))
            with self._http():
                self.client.log_text(self.run_id, text, path)
            del self.pending_artifacts[path]

    def _flush(self, *, final: bool = False) -> bool:
        """Send what is buffered unless a recent failure says to wait (`final`: try now); True when all is sent.
        Nothing after a local store's failure (`_broken`)."""
        if self.store_failure is not None:
            return False
        if not self._pending() or (not final and time.monotonic() < self.retry_at):
            return not self._pending()
        try:
            self._send()
        except Exception as exc:
            if local_failure(exc) is not None:
                self._broken(exc)
                return False
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
            return self._keep_state()
        return True

    def _outage(self, exc: BaseException, waiting: str) -> None:
        """Count a failed call, set when to try again (`retry_interval_s`, doubling up to MAX_RETRY_INTERVAL_S) and
        warn once per outage: "`waiting` after N s"."""
        cause = exc.__cause__ if isinstance(exc, Unreachable) and exc.__cause__ is not None else exc
        if self._abandoned or isinstance(cause, CloseDeadline):  # no request failed; `close()` says what is unsent
            return
        self.failures += 1
        self.outage_failures += 1
        wait = min(self.options.retry_interval_s * 2 ** (self.outage_failures - 1), MAX_RETRY_INTERVAL_S)
        self.retry_at = time.monotonic() + wait
        if self.outage_failures == 1:
            reason = redact_text(str(cause).splitlines()[0])[:300]
            log.warning(
                "MLflow at %s is not answering (%s): %s after %.0f s; training goes on",
                self.shown_uri,
                reason,
                waiting,
                wait,
            )

    def _broken(self, exc: BaseException) -> None:
        """(A local store that cannot be written, `local_failure`, or the run folder's record of the run: resending
        would not help.) Say it once, as an error, drop what is buffered and send nothing more in this attempt;
        training goes on. run.json names only the steps the store took, so a resume of the run sends the others
        from metrics.jsonl."""
        cause = local_failure(exc) or exc
        self.dropped += len(self.pending_metrics)
        self.pending_params, self.pending_tags, self.pending_metrics, self.pending_artifacts = {}, {}, [], {}
        if self.store_failure is not None:  # said already
            return
        self.store_failure = redact_text(f"{type(cause).__name__}: {cause}")
        name = Path(str(getattr(cause, "filename", None) or "")).name
        record = next((f for f in (STATE_FILE, UNSENT_FILE) if name.startswith(f)), None)  # (or its .tmp)
        what = f"the store at {self.shown_uri}" if record is None else str(self.dir / record)
        log.error(
            "MLflow: %s cannot be written (%s): not a network failure, so not retried; MLflow gets nothing more "
            "from this attempt (it lacks the steps after %d), training goes on; %s keeps every step, and a resume "
            "of this run sends the missing ones once it can be written",
            *(what, self.store_failure, self.held_step, self.run_dir / "metrics.jsonl"),
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
    def _submit(self, call: Any, step: int, *args: Any, points: int = 0, tables: int = 0) -> None:
        """Queue `call(step, *args)`, noted in the backlog with the points and sample tables it carries."""
        if self._worker is None:
            raise RuntimeError("MlflowTracker used after close()")
        self._worker.submit(self._run_queued, self._backlog.add(step, points, tables), call, step, *args)

    def _run_queued(self, number: int, call: Any, *args: Any) -> None:
        if not self._abandoned:  # else `close()` counted this call as not sent
            self._backlog.begin(number)
            call(*args)

    def truncate(self, last_step: int) -> None:
        """Queue `_truncate(last_step)`."""
        self._submit(self._truncate, last_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Queue `_log(step, metrics)` (a copy: the caller may reuse the dict)."""
        self._submit(self._log, step, dict(metrics), points=len(metrics))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Queue `_samples(step, rows)` (copies)."""
        if self.options.log_samples and rows:
            self._submit(self._samples, step, [dict(row) for row in rows], tables=1)

    def wait(self) -> None:
        """Block until the calls made so far are done (the server accepted them, or they are buffered); raise the
        error one of them raised."""
        if self._worker is not None:
            self._worker.wait()

    # `close()`, and `_close` that the worker runs last: MlflowClose (roll_core.trackers.mlflow_close)

    # ---- what the worker runs --------------------------------------------------------------------------------
    def _log(self, step: int, metrics: dict[str, float]) -> None:
        """Buffer the metrics at `step` and send the buffer (a network failure keeps it for later)."""
        if not self._ensure_run(step):
            return  # metrics.jsonl holds the step: sent when the MLflow run opens (or by a resume: `_broken`)
        self._add_metrics(step, metrics)
        self._counts(step)
        if self._keep_state() and not self._flush():
            self._bound_buffer()

    def _samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Log the rows as the table artifact `samples/step_<step>.json`."""
        if not self._ensure_run(step):
            return  # samples.jsonl holds the rows: sent when the MLflow run opens (or by a resume: `_broken`)
        self._add_samples(step, rows)
        if self._keep_state() and not self._flush():
            self._bound_buffer()


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
