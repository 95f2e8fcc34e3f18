"""Closing an MLflow run (roll_core.trackers.mlflow): `MlflowClose` holds the closing methods of `MlflowTracker`
(its base class): `close()` on the caller's thread, `_close` on the tracker's worker thread after the queued calls.

Closing is bounded: `close()` returns within `tracking.mlflow.close_timeout_s` (30 s by default) whatever the server
does. Its calls to the server (and those of the log calls still queued) get the time left, without retries, and end 1 s
before the deadline (then unsent.json: roll_core.trackers.mlflow, network failures). If the worker is still busy at the
deadline (a request made before `close()`, with its retries, or the user's MLFLOW_HTTP_REQUEST_TIMEOUT), `close()` stops
waiting: the worker makes no further call and writes nothing, and an error says how many metric points (steps a to b)
and sample tables were not sent, counted in `dropped` like the buffer's drops; metrics.jsonl keeps every step, and as
run.json names only what the server acknowledged, a resume of the run sends them. A run whose end the server was not
told (`close()` gave up, or its tries failed) would show RUNNING for good: its status and end time go to
`<run>/mlflow/end.json` and a thread of this process retries them until the server takes them
(roll_core.trackers.mlflow_end), else a resume of the run ends it. A stuck request holds up no other MLflow call of the
process (roll_core.trackers.mlflow_http).

Contract: `close(failed)` is idempotent, returns within `tracking.mlflow.close_timeout_s` and raises the first error of
a queued call or of `_close` (past the deadline it raises nothing: it logs what was not sent); the run ends FAILED when
`failed` (None: whether an exception propagates in the caller).
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from roll_core.trackers.mlflow_buffer import SAMPLES_DIR, Dropped
from roll_core.trackers.mlflow_end import END_FILE, deliver_end, record_end
from roll_core.trackers.mlflow_http import is_network_error
from roll_core.trackers.mlflow_resume import UNSENT_FILE
from roll_core.tracking import redact_text

__all__ = ["CLOSE_RESERVE_S", "MlflowClose"]

# The backend's logger: every message of the MLflow backend under one name.
log = logging.getLogger("roll_core.trackers.mlflow")
#: Of `close_timeout_s`, what the last calls to the server leave for writing unsent.json and the messages.
CLOSE_RESERVE_S = 1.0


class MlflowClose:
    """The closing methods of `MlflowTracker` (the module docstring). They use the tracker's state (`options`,
    `name`, `dir`, `run_dir`, `shown_uri`, `client`, `run_id`, `resume_step`, `seen_step`, `last_step`, `failures`,
    `dropped`, `_reported`, `store_failure`, the `pending_*` buffer, `_worker`, `_backlog`, `_end`, `_requests_by`,
    `_abandoned`, `end_delivery`) and its calls (`_timestamp`, `_open`, `_flush`, `_counts`, `_http`, `_save_unsent`,
    `_dropped_summary`, `_end_later`)."""

    def close(self, failed: bool | None = None) -> None:
        """Run `_close` after the queued calls (the run ends FAILED when `failed`; None: whether an exception
        propagates, for a caller that does not say) and stop the worker, within `tracking.mlflow.close_timeout_s`;
        raise the first error of a queued call or of `_close` (idempotent). Past the deadline it returns without the
        worker, having said what was not sent (`_abandon`)."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        if failed is None:
            failed = sys.exc_info()[0] is not None
        limit = self.options.close_timeout_s
        self._end = ("FAILED" if failed else "FINISHED", self._timestamp())
        self._requests_by = time.monotonic() + limit - CLOSE_RESERVE_S
        errors: list[BaseException] = []

        def finish() -> None:  # on a thread of its own: SerialWorker.finish waits without a timeout
            try:
                worker.finish(self._close, failed)
            except BaseException as exc:  # raised below, on the caller's thread
                errors.append(exc)

        closer = threading.Thread(target=finish, name=f"roll-mlflow-close-{self.name}", daemon=True)
        closer.start()
        closer.join(limit)
        if closer.is_alive():
            self._abandon()
        elif errors:
            raise errors[0]

    def _abandon(self) -> None:
        """(The caller's thread, the worker still busy past `close_timeout_s`.) Stop the worker's work and count
        what the server does not have, as the buffer's drops are counted (`dropped`, `Dropped`), then say it:
        metrics.jsonl keeps every step, and run.json names only what the server acknowledged, so a resume sends
        the rest."""
        self._abandoned, self._requests_by = True, 0.0  # no call the worker begins from now on reaches the server
        unsent = Dropped()
        self._backlog.unsent(unsent)  # before the buffer: a call begun meanwhile is counted twice, not missed
        tables = sum(1 for path in dict(self.pending_artifacts) if path.startswith(SAMPLES_DIR))
        unsent.add([m[3] for m in list(self.pending_metrics)], tables)
        self.dropped += unsent.points
        where = f"tracking.mlflow.close_timeout_s={self.options.close_timeout_s:g}"
        if self.run_id is None and self.resume_step is not None:  # a resumed run whose MLflow run never opened
            log.error(
                "MLflow at %s did not answer within %s: this attempt's steps (up to %d) are not in MLflow; a resume of "
                "this run sends them from metrics.jsonl",
                *(self.shown_uri, where, max(self.seen_step, unsent.last_step)),
            )
            return
        self._dropped_summary(log.error)  # what the buffer dropped earlier in this outage, if anything
        ending = self._end_later() if self.run_id is not None else ""
        if not unsent:
            log.warning(
                "MLflow at %s did not answer within %s: nothing is left unsent%s", self.shown_uri, where, ending
            )
            return
        steps = f" (steps {unsent.first_step} to {unsent.last_step})" if unsent.points else ""
        log.error(
            "MLflow at %s did not answer within %s: close() stops waiting; %d metric points%s and %d sample tables "
            "were not sent (counted as dropped): MLflow lacks them, %s and samples.jsonl keep every step, and a "
            "resume of this run sends them%s",
            *(self.shown_uri, where, unsent.points, steps, unsent.tables, self.run_dir / "metrics.jsonl", ending),
        )

    def _end_later(self) -> str:
        """(Closing) The server was not told that the run ended: record its status in END_FILE and deliver it from a
        thread of its own (roll_core.trackers.mlflow_end); what the closing message adds about it."""
        status, end_time = self._end
        kept = f"{self.dir / END_FILE}: retried while this process lives, else set when this run resumes"
        try:
            record = record_end(self.dir, str(self.run_id), status, end_time)
        except OSError as exc:  # the run folder cannot be written: delivered all the same, from memory
            record = {"run_id": str(self.run_id), "status": status, "end_time": end_time}
            kept = f"{self.dir / END_FILE} cannot be written ({exc}): retried while this process lives, else set when "
            kept += "this run resumes"
        self.end_delivery = deliver_end(
            self.client,
            self.dir,
            record,
            timeout_s=self.options.timeout_s,
            retry_interval_s=self.options.retry_interval_s,
            shown_uri=self.shown_uri,
        )
        return f"; run {self.run_id} shows RUNNING until the server takes its status {status} ({kept})"

    def _close(self, failed: bool) -> None:
        """Send what is buffered and end the run (FAILED when `failed`: `_end`); what cannot be sent goes to
        `<run>/mlflow/unsent.json` for the next attempt, an end the server was not told to END_FILE (`_end_later`).
        A resumed run whose MLflow run never opened tries once more to open it and send its steps."""
        if self._abandoned:  # `close()` gave up waiting and said what is not sent
            return
        opening = self.store_failure is None and self.run_id is None and self.resume_step is not None
        if opening and not self._open(self.seen_step) and self.store_failure is None:
            self.resume_step = None
            log.error(
                "MLflow at %s did not answer: this attempt's steps (up to %d) are not in MLflow; a resume of this run "
                "sends them from metrics.jsonl",
                self.shown_uri,
                self.seen_step,
            )
        if self.run_id is None:
            return
        # A local store that cannot be written, or run.json (`_broken`): said once, nothing is buffered
        sent = self.store_failure is not None or self._flush(final=True)
        if self.store_failure is None and [self.failures, self.dropped] != self._reported:
            self._counts(self.last_step)  # the counts go with the last data
            sent = sent and self._flush(final=True)
        sent = sent or self.store_failure is not None  # (a flush above found it: the same)
        if self._abandoned:  # `close()` gave up meanwhile, and said what is not sent
            return
        if sent:
            try:
                with self._http():
                    self.client.set_terminated(self.run_id, self._end[0], end_time=self._end[1])
            except Exception as exc:
                ending = self._end_later() if is_network_error(exc) else ""  # a refusal: resending would not help
                log.warning("MLflow: could not mark run %s as ended (%s)%s", self.run_id, redact_text(str(exc)), ending)
        else:
            kept = self._save_unsent()  # False: said (`_broken`), a resume sends the steps from metrics.jsonl
            self._dropped_summary(log.error)
            if not kept:
                ending = self._end_later()
                log.warning("MLflow at %s did not answer: the run's end is not told%s", self.shown_uri, ending)
                self.run_id = None
                return
            log.error(
                "MLflow at %s did not answer: %d metric points of run %s are in %s, sent when this run resumes "
                "(metrics.jsonl holds them too)%s",
                self.shown_uri,
                len(self.pending_metrics),
                self.run_id,
                self.dir / UNSENT_FILE,
                self._end_later(),
            )
        self.run_id = None
