"""Stopping a sweep with a signal (SIGINT/SIGTERM: Ctrl-C, a scheduler's stop), whatever its launcher and sweeper.

Contract: a stopped sweep writes its summary of the jobs that ran (ok, failed, stopped, not started), records the
job the signal stopped as `stopped`, and `roll-train` exits 128 + N (N: the first signal), whatever the launcher
(basic, roll's Ray launcher) or sweeper (basic, Optuna): the end is `SweepStopped`, whose one line roll-train prints
on stderr (`stop_report`: how many jobs finished, failed, were stopped, were not started; each failed job with its
error; where summary.md is). The exit came before roll-train's "N sweep job(s) failed" line, so a stopped sweep's
failed jobs went unsaid. An Optuna sweep's best result so far is written to `optimization_results.yaml` as the
sweeper writes it at its end, when a trial completed (roll_core.sweep_optuna.save_stopped_results): the stop left the
sweeper before it wrote it. Resuming it later (`pipeline.resume=true hydra.sweep.dir=<it>`) continues each job
folder's run (roll_core.sweep_resume).

- A signal while a job of a sweep run in this process (the basic launcher) trains is the job's own (its
  GracefulStop: it stops at a checkpoint); while it is built, its BuildStop raises StoppedWhileBuilding, which
  roll_core.sweep.run_sweep_job records as `stopped`. Either way the sweep's later jobs are not started (recorded
  as `stopped`, "not started").
- Between jobs (Hydra preparing the next one, the Optuna sweeper sampling) and in roll's Ray launcher, whose driver
  waits for jobs running in other processes, the handlers installed here for the whole sweep (`install`, by
  SweepSummaryCallback.on_multirun_start, and again by the Ray launcher after Ray's start: Ray's own SIGTERM
  handler aborts with a stack dump) take the first signal: the sweep is
  marked stopped (`roll_core.sweep.stop_sweep`); the Ray launcher then asks its running jobs to stop (a Ray cancel
  reaches a job's GracefulStop as a SIGINT: it stops at a checkpoint) and records the ones that had not started.
  A second signal aborts: `SystemExit(128 + N)`, which roll-train's sweep end (`end_unfinished_sweeps`) turns into
  the summary, with the jobs still running recorded as `stopped`.
- The Optuna sweeper (hydra-optuna-sweeper) on the basic launcher asks its next batch of trials (`study.ask`, values
  sampled) before roll sees them: a trial whose job comes after the stop is not started, gets no job record and
  its job folder (only what Hydra wrote into it) is removed; its value is an `UnstartedTrial`, whose float() (the
  sweeper reads the batch's values in trial order, after telling the earlier trials) ends the sweep with
  SweepStopped, so that trial is never told (it stays RUNNING in the study, as Optuna leaves a trial whose process
  stopped) and no further one is asked. It was returned None: told FAIL, and the sweeper asked every remaining
  trial, each a fake failure in a persistent study (`hydra.sweeper.storage`) and a folder made after the stop.
- Before, SIGTERM between jobs killed the process and Ray's driver handler made it exit 15, a SIGINT was a
  KeyboardInterrupt traceback: no summary; a stop while a job was built left the job `running` and no summary; a
  stopped sweep exited 1 (a failed sweep), an Optuna one with "No trials are completed yet".

The handlers are restored when the process's last unfinished sweep ends; one that finds no unfinished sweep (left
behind by a sweep that never ended, e.g. in a test) restores the ones it replaced and hands them the signal.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from roll_core.sweep_optuna import save_stopped_results
from roll_core.sweep_records import job_labels, write_record

log = logging.getLogger(__name__)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_old: dict[int, Any] = {}  # the handlers `install` replaced, restored by `restore`


def install() -> None:
    """Take SIGINT/SIGTERM for the sweeps of this process (main thread only: signals are delivered there)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _SIGNALS:
        old = signal.signal(sig, _handle)
        if old is not _handle:
            _old.setdefault(sig, old)


def rearm() -> None:
    """Install the handlers again after code that replaced them (`ray.init` installs Ray's SIGTERM handler: an abort
    with a stack dump), when this process's sweep had installed them."""
    if _old:
        install()


def restore() -> None:
    """Put back the handlers `install` replaced (nothing when none were installed, or off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, old in list(_old.items()):
        signal.signal(sig, old if old is not None else signal.SIG_DFL)
        del _old[sig]


def _handle(signum: int, frame: FrameType | None) -> None:
    from roll_core import sweep

    live = sorted(sweep._unfinished)
    if not live:  # no sweep of this process is running: the signal means what it meant before the sweep
        old = _old.get(signum, signal.SIG_DFL)
        restore()
        if callable(old):
            old(signum, frame)
        elif old != signal.SIG_IGN:
            signal.raise_signal(signum)
        return
    name = signal.Signals(signum).name
    if any(sweep.stop_signal(folder) is not None for folder in live):  # the second: abort now
        log.error("%s received again: aborting the sweep; summarising the jobs it ran", name)
        raise SystemExit(128 + signum)
    for folder in live:
        sweep.stop_sweep(folder, signum, f"the sweep was stopped by signal {signum}")
    log.warning(
        "%s received: stopping the sweep (running jobs stop at a checkpoint, later jobs are not started, then the "
        "summary is written; send it again to abort now)",
        name,
    )


class SweepStopped(SystemExit):
    """The end of roll-train for a sweep a signal stopped: exit status 128 + `signum`, and `report`, the one line
    roll-train prints on stderr (see `stop_report`). A SystemExit: Hydra lets it through its callbacks, launchers
    and sweepers."""

    def __init__(self, signum: int, report: str) -> None:
        super().__init__(128 + signum)
        self.signum, self.report = signum, report


def job_outcome(record: dict[str, Any]) -> str:
    """What a job of a stopped sweep did, from its record: `finished` (ok), `stopped` (stopped while it ran or was
    built), `not started` (stopped before it started: its error says "not started", as summary.md shows it) or
    `failed` (failed, killed, or a record with no end: still `running`)."""
    status = record.get("status")
    if status == "ok":
        return "finished"
    if status == "stopped":
        return "not started" if "not started" in str(record.get("error") or "") else "stopped"
    return "failed"


def stop_report(
    sweep_dir: Path, signum: int, records: tuple[list[tuple[Path, dict[str, Any]]], list[str]] | None
) -> str:
    """The line that tells the user a signal stopped the sweep in `sweep_dir`: how many of its jobs finished, failed,
    were stopped and were not started, each failed job (its swept values and the first line of its error) and where
    summary.md is. `records`: the sweep's job records and unreadable ones (roll_core.sweep_records.job_records),
    None when they could not be read."""
    head = f"the sweep was stopped by signal {signum} ({signal.Signals(signum).name})"
    where = f"Each job's outcome and error: {sweep_dir / 'summary.md'}"
    if records is None:
        return f"{head}; its job records could not be read. {where}"
    found, problems = records
    jobs = [st for _, st in found]
    counts = {"finished": 0, "failed": len(problems), "stopped": 0, "not started": 0}
    failed: list[str] = []
    for st, label in zip(jobs, job_labels(jobs)):
        outcome = job_outcome(st)
        counts[outcome] += 1
        if outcome == "failed":
            lines = str(st.get("error") or f"status {st.get('status', 'unknown')}").strip().splitlines() or [""]
            error = lines[0] if len(lines[0]) <= 200 else lines[0][:199] + "…"  # one line: the summary has it whole
            failed.append(f"{label} ({error})")
    failed += problems
    total = len(jobs) + len(problems)
    line = f"{head}: {total} job(s): " + ", ".join(f"{n} {what}" for what, n in counts.items()) + "."
    if failed:
        line += f" Failed: {'; '.join(failed)}."
    return f"{line} {where}"


def exit_stopped(
    sweep_dir: Path, signum: int, records: tuple[list[tuple[Path, dict[str, Any]]], list[str]] | None
) -> NoReturn:
    """End roll-train for a sweep a signal stopped (its summary is written: this is called after it): raise
    SweepStopped, exit 128 + `signum` as a single run stopped by it, with the line roll-train prints (`stop_report`
    of the sweep's job `records`, as summarised). It exited before roll-train could say which jobs had failed. An
    Optuna sweeper's best result so far is saved first (roll_core.sweep_optuna.save_stopped_results: the sweeper
    writes it only at the end of its sweep, which the stop leaves by an exception), from the study roll kept for
    the sweep (roll_core.sweep_optuna.watch_sweep)."""
    save_stopped_results(sweep_dir)
    log.error(
        "the sweep was stopped by signal %s (%s): its jobs and what they did: %s",
        signum,
        signal.Signals(signum).name,
        sweep_dir / "summary.md",
    )
    raise SweepStopped(signum, stop_report(sweep_dir, signum, records))


def asks_trials(hc: Any) -> bool:
    """Whether the sweep of the job whose Hydra config is `hc` is run by hydra-optuna-sweeper, which asks Optuna for
    each batch of trials before its jobs run (Hydra's grid sweeper knows every job beforehand: a job after a stop
    is recorded `not started`)."""
    target = str((hc.get("sweeper") or {}).get("_target_") or "")
    return target.startswith("hydra_plugins.hydra_optuna_sweeper.")


class UnstartedTrial:
    """What roll's job wrapper hands the Optuna sweeper for a trial it asked after a signal stopped the sweep (see
    the module's docstring). hydra-optuna-sweeper reads each trial's objective with float() (a multi-objective one
    iterates it), in trial order, after it told the batch's earlier trials; here that calls `end`, which ends the
    sweep (summary, then SweepStopped: a SystemExit, which the sweeper does not catch). So this trial is not told
    (RUNNING in the study: not a failure, not PRUNED, which TPE counts as a bad result) and no trial is asked after
    it. WAITING would hand its values to the next ask of a continued study, but GridSampler then gives it another
    grid point than its values (Optuna 2.x): RUNNING is what Optuna itself leaves for a trial whose process
    stopped, and GridSampler evaluates such a point again once the others are started."""

    def __init__(self, job: int, end: Callable[[], NoReturn]) -> None:
        self.job, self._end = job, end

    def __float__(self) -> float:
        self._end()

    def __iter__(self) -> Any:
        self._end()

    def __repr__(self) -> str:
        return f"<trial of job {self.job}: not started, the sweep was stopped>"


_HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def remove_unstarted_folder(job_dir: Path, hydra_subdir: str | None, log_name: str, sweep_dir: Path) -> bool:
    """Remove the folder Hydra made for a trial that was not started (its `hydra_subdir` holding config.yaml,
    hydra.yaml and overrides.yaml, and its job log `log_name`) and its parents left empty below `sweep_dir`.
    Anything else in it (an earlier sweep's job record, checkpoints) keeps it whole: only files Hydra wrote for
    this job are unlinked, and a folder is removed only when empty. Returns whether it was removed."""
    if job_dir.resolve() == sweep_dir.resolve() or not job_dir.is_dir():
        return False
    sub = job_dir / hydra_subdir if hydra_subdir else None
    known = {log_name} | ({hydra_subdir} if hydra_subdir else set())
    try:
        if {p.name for p in job_dir.iterdir()} - known or (
            sub is not None and sub.exists() and {p.name for p in sub.iterdir()} - set(_HYDRA_FILES)
        ):
            log.warning("kept the folder %s of a trial that was not started: it holds more than Hydra wrote", job_dir)
            return False
        for path in [job_dir / log_name, *(sub / f for f in _HYDRA_FILES if sub is not None)]:
            path.unlink(missing_ok=True)
        if sub is not None and sub.exists():
            sub.rmdir()
        job_dir.rmdir()
        for parent in job_dir.parents:  # a nested hydra.sweep.subdir (a/b): its empty parents, not the sweep's
            if parent.resolve() == sweep_dir.resolve() or sweep_dir.resolve() not in parent.resolve().parents:
                break
            if any(parent.iterdir()):
                break
            parent.rmdir()
    except OSError as exc:  # bookkeeping: the sweep still ends and is summarised
        log.warning("could not remove the folder %s of a trial that was not started: %s", job_dir, exc)
        return False
    return True


def mark_unended(found: list[tuple[Path, dict[str, Any]]], signum: int) -> None:
    """Record the jobs of a stopped sweep still `running` (their process ended with the sweep's: it was aborted) as
    `stopped`, in their job_status.json and in `found` (the sweep's job records: sweep_records.job_records)."""
    for job_dir, record in found:
        if record.get("status") == "running":
            record.update(status="stopped", error=f"stopped by signal {signum}: the sweep was aborted while it ran")
            try:
                write_record(job_dir, record)
            except OSError as exc:  # the summary still shows it stopped
                log.warning("could not record job %s as stopped: %s", record.get("job"), exc)
