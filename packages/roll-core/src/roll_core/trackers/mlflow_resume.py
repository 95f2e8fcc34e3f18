"""Resuming an MLflow run (roll_core.trackers.mlflow): which MLflow run a resumed roll run logs to, and how it is
sent the steps it lacks. `MlflowResume` holds these methods of `MlflowTracker` (its base class); they run on the
tracker's worker thread like the rest of its calls.

`<run>/mlflow/run.json` (STATE_FILE) records the tracking URI (without userinfo), whether the store is the run
folder's own (`local`: then it is the same store after the folder moved, `recorded_store_is_this`), the MLflow run id
and the last step logged to it. MLflow cannot delete metric points (a point logged again at the same step is a
second point, not a replacement), so `truncate(last_step)` does one of two things:
- the MLflow run holds nothing after `last_step` (a preemption right after a checkpoint): the same run continues;
  run.json's last step and the server's last point must agree on that (an attempt that ended mid-send left the
  server holding steps run.json does not name: a new run, as below);
- it holds later steps (a crash between checkpoints; the run redoes them with other values): a new MLflow run
  (same experiment and name, tag `roll.resumed_from=<old id>`) replays steps 0..last_step from the run folder's
  metrics.jsonl and samples.jsonl, then continues; the old run gets tag `roll.superseded_by=<new id>` and is
  moved to MLflow's deleted runs (kept, and restorable with `mlflow runs restore --run-id <id>`).
Either way the MLflow run that run.json names shows exactly the history of metrics.jsonl: a continued run is sent
the steps up to `last_step` it lacks (an attempt that ran without mlflow, or died with points not yet sent: run.json
counts only the steps the server acknowledged or unsent.json (UNSENT_FILE) keeps, and a continued run loads
unsent.json first).

A run.json the resume cannot use (cut by a crash of an attempt that wrote it in place, its `run_id` or `last_step`
missing or of another type) is warned about once, naming it, and taken for none: a new MLflow run replays the run
folder's steps (the run it recorded, if any, is left as it is). It raised into training.
An unsent.json of the recorded run that the resume cannot use (cut by a crash while `close()` wrote it, a part
missing or of another type) is warned about once, naming it, and the run is not continued: a new MLflow run replays
the run folder's steps and supersedes it, as above. Its points are counted in run.json's last step, and which of
them the server lacks is not known exactly (a step the server took in part, a sample table unsent after its points):
continued, the run lost them or showed some twice. It raised into training.

A resumed run whose server does not answer goes on without it: a warning says so (counted as a failed send), and
the MLflow run is opened (continued or replaced, as above) at a later log once the server answers (`_ensure_run`),
then sent the steps it lacks from metrics.jsonl.

A run that starts at step 0 in a folder whose run.json names a run of this store (an attempt killed before its first
checkpoint, run again: nothing to resume from) retires that run the same way unless it finished (`_start_over`; the
status end.json records counts): it stayed active beside the new one, under the same name in the same experiment,
with the abandoned steps (RUNNING for good after a kill). A FINISHED one is a complete earlier run of the folder: kept.

A run whose end the server was not told (`<run>/mlflow/end.json`, roll_core.trackers.mlflow_end) is reopened by the
resume: continued (its own `close()` ends it) or superseded (KILLED); either way the record is moot and removed, and
this process's delivery of it stops.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from roll_core.trackers.mlflow_buffer import LOGGED_ARTIFACTS_TAG
from roll_core.trackers.mlflow_end import read_end, reopened
from roll_core.trackers.mlflow_http import Unreachable, is_network_error, local_failure
from roll_core.trackers.mlflow_keys import flatten_config
from roll_core.trackers.replay import kept_metrics, kept_samples
from roll_core.tracking import redact_config, redact_exception, redact_text

__all__ = ["LOCAL_DB", "STATE_FILE", "UNSENT_FILE", "MlflowResume", "recorded_store_is_this"]

# The backend's logger: every message of the MLflow backend under one name.
log = logging.getLogger("roll_core.trackers.mlflow")
#: The run folder's record of its MLflow run: {"tracking_uri", "run_id", "last_step"}.
STATE_FILE = "run.json"
#: What could not be sent by `close()`: sent when the run resumes.
UNSENT_FILE = "unsent.json"
#: How the URI of a run folder's own store ends (roll_core.trackers.mlflow: `sqlite:///<run>/mlflow/mlflow.db`).
LOCAL_DB = "/mlflow/mlflow.db"


class MlflowResume:
    """The resume methods of `MlflowTracker` (the module docstring). They use the tracker's state (`run_id`,
    `last_step`, `held_step`, `resume_step`, `seen_step`, `retry_at`, `store_failure`, `state_said`, the `pending_*`
    buffer, `tables`, `keys`) and its calls (`_start`, `_http`, `_flush`, `_outage`, `_broken`, `_keep_state`,
    `_config_text`, `_add_metrics`, `_add_samples`)."""

    def _start_over(self) -> None:
        """Start the MLflow run of a run that starts at step 0 (not resumed), and retire the earlier attempt's run
        that run.json names in this store unless it finished (the module docstring)."""
        path = self.dir / STATE_FILE
        try:
            state = json.loads(path.read_text()) if path.exists() else None
        except ValueError:  # cut by a crash mid-write (run.json is replaced whole since): nothing to retire
            state = None
        same_store = isinstance(state, dict) and recorded_store_is_this(
            state, self.uri, self.shown_uri, self.local_store
        )
        earlier = str(state["run_id"]) if same_store and state.get("run_id") else None
        self._start()
        if earlier is None or earlier == self.run_id:
            return
        try:
            with self._http():
                run = self.client.get_run(earlier)
        except Exception as exc:  # gone (deleted for good, a new database): nothing to retire
            log.info("MLflow: the earlier attempt's run %s is not retired (%s)", earlier, redact_text(str(exc)))
            return
        told = read_end(self.dir)  # an end the server was not told: the run may have finished all the same
        status = told["status"] if told is not None and told.get("run_id") == earlier else run.info.status
        if run.info.lifecycle_stage == "deleted" or status == "FINISHED":
            return
        if self._supersede(earlier, str(self.run_id)):
            reopened(self.dir, earlier)  # KILLED now: an end recorded for it is moot
            log.info(
                "MLflow: run %s of an earlier attempt in %s (%s, not resumed: no checkpoint) is superseded by %s",
                *(earlier, self.run_dir, status, self.run_id),
            )

    def _truncate(self, last_step: int) -> None:
        """Continue the recorded run when it holds nothing after `last_step`, else start a new one replaying steps
        0..last_step (MLflow cannot delete points; see the module docstring). A server that does not answer is
        warned about, and the run is opened at a later log. With the run open (a restart in the process), a new run
        that cannot be started is what `_open` makes of it: the server away, opened at a later log; a local store
        that cannot be written, said once (`_broken`); never raised into training."""
        if self.run_id is not None:
            if self.last_step <= last_step:
                self.pending_metrics = [m for m in self.pending_metrics if m[3] <= last_step]
                return
            old = self.run_id
            self.pending_metrics, self.pending_artifacts, self.pending_tags = [], {}, {}
            # The open run is valid up to `last_step` only: run.json says so before the new run starts, so a resume
            # after a failed start (below, or a crash) replaces it (continued, it showed the redone steps' old values)
            self.held_step = min(self.held_step, last_step)
            if not self._keep_state():  # said once (`_broken`): nothing more is sent
                return
            try:
                self._start(resumed_from=old)
            except Unreachable as exc:  # opened at a later log, as a resumed run whose server did not answer
                self.run_id, self.resume_step, self.seen_step = None, last_step, last_step
                self._outage(
                    exc, "the MLflow run replacing the redone steps is opened, and sent them from metrics.jsonl,"
                )
                return
            except RuntimeError as exc:  # a local store that cannot be written: said once, training goes on
                if local_failure(exc) is None:
                    raise
                self._broken(exc)
                return
            self._supersede(old, str(self.run_id))
            self._replay(last_step)
            return
        self.resume_step = last_step if self.resume_step is None else min(self.resume_step, last_step)
        self.seen_step = last_step
        if self.store_failure is None:  # (else said once, `_broken`: a later resume opens it)
            self._open(last_step)

    def _open(self, upto: int) -> bool:
        """Open a resumed run's MLflow run: the recorded one when it holds nothing after `resume_step`, else a new
        one; then send it the steps up to `upto` it lacks, from the run folder's files. False (counted, warned once)
        when the server does not answer: the steps wait in metrics.jsonl, and a log after `retry_at` tries again."""
        assert self.resume_step is not None
        state = self._recorded()
        same_store = state is not None and recorded_store_is_this(state, self.uri, self.shown_uri, self.local_store)
        try:
            recorded = int(state["last_step"]) if same_store else None
            if recorded is not None and recorded <= self.resume_step and self._continue(str(state["run_id"]), recorded):
                self.resume_step = None
                self.last_step = self.held_step = int(state["last_step"])
                if not self._keep_state():  # said once (`_broken`); a resume sends the steps
                    return False
                reopened(self.dir, str(state["run_id"]))  # the run goes on: its old end is moot
                for _, metrics in kept_metrics(self.run_dir, self.held_step):  # the names its keys have there
                    self.keys.names_of(metrics)
                # the steps it lacks: an attempt that ran without this tracker, or died with its points unsent
                self._replay(upto, after=self.held_step)
                return True
            self._start(resumed_from=str(state["run_id"]) if same_store else None)
        except Unreachable as exc:
            self._outage(exc, "this resumed run's MLflow run is opened, and sent its steps from metrics.jsonl,")
            return False
        except RuntimeError as exc:  # `_start` in a local store that cannot be written: said once, training goes on
            if local_failure(exc) is None:
                raise
            self._broken(exc)
            return False
        self.resume_step = None
        if same_store and self._supersede(str(state["run_id"]), str(self.run_id)):
            reopened(self.dir, str(state["run_id"]))  # KILLED now: its old end is moot
        self._replay(upto)
        return True

    def _recorded(self) -> dict[str, Any] | None:
        """run.json's record for `_open`; None when there is none, or none it can use (cut by a crash of an attempt
        that wrote it in place, a `run_id` or `last_step` missing or of another type): warned about once, naming
        the file, and the resume starts a new run that is sent the folder's steps, as for a folder without a record.
        (It raised into training: a ValueError, a KeyError.)"""
        path = self.dir / STATE_FILE
        if not path.exists():
            return None
        try:
            state = json.loads(path.read_text())
            bad = None if isinstance(state, dict) else f"not an object: {type(state).__name__}"
        except (OSError, ValueError) as exc:
            state, bad = None, f"{type(exc).__name__}: {exc}"
        if bad is None:
            run_id, last_step = state.get("run_id"), state.get("last_step")
            if not isinstance(run_id, str) or not run_id:
                bad = f"run_id is {run_id!r}"
            elif not isinstance(last_step, int) or isinstance(last_step, bool):
                bad = f"last_step is {last_step!r}"
        if bad is None:
            return state
        if not self.state_said:
            self.state_said = True
            log.warning(
                "MLflow: %s cannot be used (%s): this resumed run starts a new MLflow run, sent the run folder's "
                "steps from metrics.jsonl (the run it recorded, if any, is left as it is)",
                *(path, redact_text(bad)[:300]),
            )
        return None

    def _ensure_run(self, step: int) -> bool:
        """Whether the MLflow run is open to log `step`; a resumed run's is opened here when `truncate` did not
        (it was not called, or the server did not answer: tried again once `retry_at` has passed). Never after a
        local store's failure (`_broken`): nothing more is sent."""
        if self.store_failure is not None:
            return False
        if self.run_id is not None:
            return True
        if self.resume_step is None:  # a resumed run logged without truncating first: keep what precedes this step
            self.resume_step = step - 1
        self.seen_step = max(self.seen_step, step)
        return time.monotonic() >= self.retry_at and self._open(step - 1) and self.store_failure is None

    def _continue(self, run_id: str, recorded: int) -> bool:
        """Continue the recorded run; False when the store no longer has it (deleted or another store), or when it
        holds a step after `recorded`, run.json's last step: an attempt died after the server took points and
        before run.json said so (a kill mid-send, a slow server's answer never read). Continued, that run showed
        its own step twice (replayed from metrics.jsonl) and the abandoned values of the steps redone after it."""
        try:
            with self._http():
                run = self.client.get_run(run_id)
                held = _last_step(self.client, run)
        except Exception as exc:
            if is_network_error(exc):
                raise Unreachable(
                    f"MLflow at {self.shown_uri}: cannot reach the run {run_id} ({redact_text(str(exc))})"
                ) from redact_exception(exc)
            return False
        if run.info.lifecycle_stage == "deleted":
            return False
        if held > recorded:
            log.warning(
                "MLflow: run %s holds steps up to %d, after the %d that %s records (an attempt ended while sending): "
                "a new run replays the run folder's steps",
                *(run_id, held, recorded, self.dir / STATE_FILE),
            )
            return False
        usable, unsent = self._read_unsent(run_id)
        if not usable:  # run.json counts its points as held: continued, the run lacked them for good
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
        if unsent is not None:
            self._load_unsent(unsent)
        return True

    def _supersede(self, old: str, new: str) -> bool:
        """Tag the abandoned run and move it to MLflow's deleted runs (restorable); a failure only warns (False)."""
        try:
            with self._http():
                self.client.set_tag(old, "roll.superseded_by", new)
                self.client.set_terminated(old, "KILLED")
                self.client.delete_run(old)
        except Exception as exc:  # the new run is complete without this: never fail the resume for it
            log.warning("MLflow: could not mark the superseded run %s (%s)", old, redact_text(str(exc)))
            return False
        return True

    def _replay(self, last_step: int, after: int = -1) -> None:
        """Log what the run folder's own files hold of the steps in (`after`, `last_step`] into the run."""
        samples = kept_samples(self.run_dir, last_step, after)
        for step, metrics in kept_metrics(self.run_dir, last_step, after):
            self._add_metrics(step, metrics)
        for step, rows in sorted(samples.items()):
            self._add_samples(step, rows)
        self._flush(final=True)

    def _read_unsent(self, run_id: str) -> tuple[bool, dict[str, Any] | None]:
        """unsent.json's buffer for `_continue` of the run `run_id`: (True, None) when there is none or it is another
        run's. (False, None) when it cannot be used (cut by a crash while `close()` wrote it, a part missing or of
        another type): warned about once, naming the file, and the run is not continued: a new MLflow run replays
        the run folder's steps (the module docstring). Continuing and replaying from metrics.jsonl after the
        server's last step cannot be exact: a step whose points the server took only in part (a batch cut inside
        it), or whose sample table was still unsent after its points, is either sent twice or lost. (It raised
        into training: a ValueError, a KeyError.)"""
        path = self.dir / UNSENT_FILE
        if not path.exists():
            return True, None
        try:
            unsent = json.loads(path.read_text())
            bad = _unsent_problem(unsent, run_id)
        except (OSError, ValueError) as exc:
            unsent, bad = None, f"{type(exc).__name__}: {exc}"
        if bad is None:
            return True, (unsent if unsent["run_id"] == run_id else None)
        if not self.state_said:
            self.state_said = True
            log.warning(
                "MLflow: %s cannot be used (%s): run %s is not continued (the points it lacks are not known); this "
                "resumed run starts a new MLflow run, sent the run folder's steps from metrics.jsonl",
                *(path, redact_text(bad)[:300], run_id),
            )
        return False, None

    def _load_unsent(self, unsent: dict[str, Any]) -> None:
        """Put unsent.json's buffer (`_read_unsent`) before what is buffered now."""
        self.pending_params = {**unsent["params"], **self.pending_params}
        self.pending_tags = {**unsent["tags"], **self.pending_tags}
        self.pending_metrics = [tuple(m) for m in unsent["metrics"]] + self.pending_metrics  # type: ignore[misc]
        self.pending_artifacts = {**unsent["artifacts"], **self.pending_artifacts}
        log.info("MLflow: %d metric points of an earlier attempt are sent now", len(unsent["metrics"]))


def _unsent_problem(unsent: Any, run_id: str) -> str | None:
    """Why unsent.json's content (as `MlflowTracker._save_unsent` writes it) cannot be used for the run `run_id`;
    None when it can. One of another run (its `run_id` a string) is not looked into: it is not loaded."""
    if not isinstance(unsent, dict):
        return f"not an object: {type(unsent).__name__}"
    recorded = unsent.get("run_id")
    if not isinstance(recorded, str) or not recorded:
        return f"run_id is {recorded!r}"
    if recorded != run_id:
        return None
    for part in ("params", "tags", "artifacts"):
        value = unsent.get(part)
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return f"{part} is not an object of strings"
    metrics = unsent.get("metrics")
    if not isinstance(metrics, list):
        return f"metrics is {type(metrics).__name__}, not a list"
    for point in metrics:
        if not (isinstance(point, list) and len(point) == 4 and isinstance(point[0], str)):
            return f"a metric point is {str(point)[:80]}"
        value, timestamp, step = point[1:]
        if not (_number(value) and _integer(timestamp) and _integer(step)):
            return f"a metric point is {str(point)[:80]}"
    return None


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, float) or _integer(value)


def recorded_store_is_this(state: dict[str, Any], uri: str, shown_uri: str, local: bool) -> bool:
    """Whether run.json's `state` names the store at `uri` (`shown_uri`: without userinfo; `local`: the run folder's
    own store). The URI as recorded (without userinfo; one written before that: with it), or, for the run folder's own
    store, a recorded local store wherever the folder was: its path in the URI is where the folder was then, and a
    moved folder's resume took its own store for another, starting a second MLflow run beside the recorded one (left
    active with the values of the steps the resume redoes). A run.json written before `local` was recorded: a local
    store's URI is `sqlite:///<run>/mlflow/mlflow.db`."""
    recorded = state.get("tracking_uri")
    if recorded in (shown_uri, uri):
        return True
    was_local = state.get("local")
    if was_local is None:
        was_local = isinstance(recorded, str) and recorded.startswith("sqlite:///") and recorded.endswith(LOCAL_DB)
    return local and bool(was_local)


def _last_step(client: Any, run: Any) -> int:
    """The last step at which an MLflow run holds a metric point (-1: none). MLflow's latest value of a metric is
    that of its last step: the run's own record has them (`RunData._metric_objs`, no request), else each metric's
    history is read."""
    latest = getattr(run.data, "_metric_objs", None)
    if latest is None:
        latest = [p for key in run.data.metrics for p in client.get_metric_history(run.info.run_id, key)]
    return max((int(point.step) for point in latest), default=-1)
