"""Stopping a sweep with a signal (SIGINT/SIGTERM: Ctrl-C, a scheduler's stop), whatever its launcher and sweeper.

Contract: a stopped sweep writes its summary of the jobs that ran (ok, failed, stopped, not started), records the
job the signal stopped as `stopped`, and `roll-train` exits 128 + N (N: the first signal). Resuming it later
(`pipeline.resume=true hydra.sweep.dir=<it>`) continues each job folder's run (roll_core.sweep_resume).

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
from pathlib import Path
from types import FrameType
from typing import Any

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


def exit_stopped(sweep_dir: Path, signum: int) -> None:
    """End roll-train for a sweep a signal stopped: exit 128 + `signum`, as a single run stopped by it (the summary
    is written: this is called after it)."""
    log.error(
        "the sweep was stopped by signal %s (%s): its jobs and what they did: %s",
        signum,
        signal.Signals(signum).name,
        sweep_dir / "summary.md",
    )
    raise SystemExit(128 + signum)


def mark_unended(found: list[tuple[Path, dict[str, Any]]], signum: int) -> None:
    """Record the jobs of a stopped sweep still `running` (their process ended with the sweep's: it was aborted) as
    `stopped`, in their job_status.json and in `found` (the sweep's job records, see roll_core.sweep.job_records)."""
    from roll_core.sweep import write_record

    for job_dir, record in found:
        if record.get("status") == "running":
            record.update(status="stopped", error=f"stopped by signal {signum}: the sweep was aborted while it ran")
            try:
                write_record(job_dir, record)
            except OSError as exc:  # the summary still shows it stopped
                log.warning("could not record job %s as stopped: %s", record.get("job"), exc)
