"""Hydra multirun sweeps of `roll-train`: job slots, per-job status, failure isolation and the sweep summary.

How a sweep runs (`roll-train -m algo=grpo,ppo algo.lr=1e-6,3e-6 hydra/launcher=ray`):
- Hydra expands the overrides into jobs; the Ray launcher (hydra-ray-launcher) starts each job as a Ray task
  that reserves no CPU (roll_core/conf/hydra/launcher/ray.yaml), on the same cluster its RL roles are placed on.
- Each job first takes a slot from a named Ray actor (`JobSlots`) holding `cluster.max_concurrent` permits,
  so a sweep on a small machine queues instead of oversubscribing it (0 = no bound). A slot is a lease the job
  renews every few seconds from a thread: a job that raises releases it at once, and one that is killed
  (SIGKILL, OOM, a lost node) stops renewing, so its slot returns after `lease_s` and the sweep goes on. The actor
  is the sweep's own (named by its folder and sweep id: a sweep run again into the folder never finds an aborted
  one's), removed at the sweep's end or by roll's Ray launcher when the sweep is aborted. `cluster.max_concurrent`
  is a setting of the whole sweep: roll's Ray launcher refuses a sweep whose jobs give it different values.
- A job that raises (while it is prepared or waits for its slot too) is caught, logged and recorded in
  `<job dir>/job_status.json` (written, found and labelled by roll_core.sweep_records); the other jobs go on. A
  job whose process dies (SIGKILL, OOM) is recorded as `killed` by roll's Ray launcher (roll_core.sweep_launcher).
  A job stopped early by a signal (SIGTERM, Ctrl-C: its checkpoint is written) is recorded as `stopped`. Failed,
  killed and stopped jobs, and finished ones without a finite final held-out accuracy, return None to the sweeper:
  the Optuna sweeper records a failed trial for a value it cannot cast to float and goes on (a NaN made Optuna's
  `tell` raise and the whole sweep end there).
- A signal that stops a job of a sweep run in this process (the basic launcher: Ctrl-C, a scheduler's SIGTERM),
  while it trains or while its pipeline is built (StoppedWhileBuilding, recorded as `stopped`), stops the sweep:
  its later jobs are not started but recorded as `stopped` ("not started"), so the sweep ends, is summarised and
  roll-train exits 128+N. It started the next job instead, and a Ctrl-C stopped one job at a time. A signal between
  jobs, to an Optuna sweep or to the Ray launcher's driver stops the sweep the same way (roll_core.sweep_stop).
  An Optuna sweep asks no trial after the stop; one asked before roll saw it is not started, never told to Optuna,
  with no record or folder (sweep_stop.UnstartedTrial: it was a failed trial, and every remaining one was asked).
  roll-train then prints one line on stderr: how many jobs finished, failed (each named, with its error), were
  stopped and were not started, and where summary.md is (sweep_stop.SweepStopped: the exit came before roll-train's
  "N sweep job(s) failed" line, so a stopped sweep never said which jobs had failed).
- A sweep resumed into an earlier sweep's folder (`pipeline.resume=true hydra.sweep.dir=<it>`) continues each job
  folder's run: a job whose settings differ from the ones the folder's earlier job ran with (values given in
  another order, an Optuna trial sampling other values, a changed lr after a sweep of one job; only the run's
  length, cadence, logging and cluster may change: sweep_resume.RESUMABLE) fails with a clear error instead of
  continuing another job's checkpoint with its own learning rate (a resume accepts a changed lr).
- A job given the folder of another job of its sweep (`hydra.sweep.subdir=${hydra.job.override_dirname}` with a
  repeated value, an Optuna trial sampling a point again) under a launcher that cannot refuse it at launch (Hydra's
  basic one; roll's Ray launcher does) fails without writing there, its record in `refused_jobs/job_<number>`
  (roll_core._sweep_folders): it replaced the other job's record, which left the summary, or continued its run.
- `SweepSummaryCallback.on_multirun_start` writes `sweep_id.json` (a fresh id, the start time) into the sweep
  folder; every job record carries that id, so a sweep run again into the same folder summarises and counts its own
  jobs only (the earlier sweep's records are left out, with a warning).
- Trackers see one sweep as one group: each job's `tracking.group` (unless given) is "<experiment>-<sweep folder>"
  (W&B group, MLflow experiment, SwanLab group) and its `tracking.run_name` is "<experiment>-<job number>" (one
  given without interpolation: "<name>-<job number>"), so the jobs are distinct runs of one group (`sweep_tracking`).
- After the last job, `SweepSummaryCallback.on_multirun_end` finds this sweep's job records anywhere under the sweep
  folder (job folders nest with `hydra.sweep.subdir=${hydra.job.override_dirname}`), writes `summary.csv`, `summary.md`
  and `rewards.png` (every job's reward curve, one line per job; roll_core.sweep_summary) into it, each whole or not at
  all (a temporary file renamed over it: a sweep killed while writing never leaves half a summary; a plot that fails is
  logged, the tables are still written; a job's final held-out accuracy is its run summary's: missing where a stop
  skipped its final evaluation, its error cell saying so); with no job record, summary.md says so and an earlier sweep's
  summary.csv and rewards.png are removed (never shown as this sweep's), and `roll-train` exits non-zero if any job was
  not `ok` or no job record of the sweep was found. The failures are counted before the summary is written, so a summary
  that cannot be written (Hydra turns a callback's exception into a warning) never hides them. A sweep whose sweeper
  raises (hydra-optuna-sweeper when every trial failed: Optuna has no best trial) skips `on_multirun_end`: `roll-train`
  then summarises it (`end_unfinished_sweeps`) and exits 1 with a message naming the failed jobs and summary.md, instead
  of only the sweeper's traceback.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from hydra.experimental.callback import Callback

from roll_core import sweep_stop
from roll_core._sweep_folders import claim_folder, folder_owner, refused_folder, shared_folder_error
from roll_core._sweep_tracking import sweep_group as sweep_group  # re-exported: its home was here
from roll_core._sweep_tracking import sweep_tracking
from roll_core.errors import ConfigError
from roll_core.eval_history import no_outcome_in
from roll_core.sweep_optuna import prepare_study_storage, unwatch, watch_sweep
from roll_core.sweep_records import STATUS_FILE, job_labels, job_records, write_record
from roll_core.sweep_resume import check_resumed_folder, record_folder_run
from roll_core.sweep_slots import SLOTS_NAMESPACE, job_slot, slots_name
from roll_core.sweep_summary import write_summary

log = logging.getLogger(__name__)
SWEEP_FILE = "sweep_id.json"
_failed_jobs: list[str] = []
_sweeps: dict[str, dict[str, Any]] = {}  # resolved sweep folder -> its sweep_id.json, in the process that started it
# resolved sweep folder -> (the signal that stopped the sweep, why its later jobs are not started)
_stopped: dict[str, tuple[int, str]] = {}
_unfinished: set[str] = set()  # resolved sweep folders started in this process whose end was not summarised yet
# resolved sweep folder -> (job folder, its Hydra subfolder, its log's name) of each trial an Optuna sweeper asked
# after the sweep was stopped: removed when the sweep ends (sweep_stop.UnstartedTrial)
_unstarted: dict[str, list[tuple[Path, str | None, str]]] = {}


def run_sweep_job(cfg: Any, run: Any) -> float | sweep_stop.UnstartedTrial | None:
    """Run one multirun job with failure isolation; returns the value a sweeper optimises (None unless the job
    finished with a finite accuracy: see job_value). Whatever raises, preparing the job and taking its slot
    included, is recorded as a failed job: an exception out of here makes Hydra's sweeper raise, skipping the
    sweep's summary. A stop signal out of the job (KeyboardInterrupt: StoppedWhileBuilding while it was built, a
    second signal aborting it, a Ray cancel) records it as `stopped` and, in the sweep's process, stops the sweep.
    After a signal stopped this sweep in this process, the job is not started: recorded `not started`, or, for an
    Optuna trial, not recorded at all and answered with a sweep_stop.UnstartedTrial that ends the sweep."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    record: dict[str, Any] = {"job": hc.job.num, "overrides": list(hc.overrides.task), "status": "running"}
    t0 = time.perf_counter()
    sweep_dir: Path | None = None
    dest = out  # where this job's record goes: elsewhere when `out` is another job's (roll_core._sweep_folders)
    try:
        sweep_dir = job_sweep_dir(hc)
        record["sweep_id"] = sweep_marker(sweep_dir).get("sweep_id")  # which sweep this record belongs to
        if str(sweep_dir) in _stopped and str(sweep_dir) in _sweeps and sweep_stop.asks_trials(hc):
            return _unstarted_trial(hc, out, sweep_dir)
        # The record's check, then the atomic claim: jobs that all passed the first before any wrote its record
        # (a parallel launcher, jobs queued for a max_concurrent slot) meet at the second.
        owner = folder_owner(out, record) or claim_folder(out, record)
        if owner is not None:  # before anything is written: that job's record and run stay its own
            dest = refused_folder(sweep_dir, hc.job.num)
            record["folder"] = str(out)
            raise ConfigError(shared_folder_error(out, record, owner, dest))
        if str(sweep_dir) in _stopped:
            log.error("sweep job %s is not started: %s", hc.job.num, _stopped[str(sweep_dir)][1])
            record.update(status="stopped", error=f"not started: {_stopped[str(sweep_dir)][1]}")
            record_folder_run(out, record)  # a resumed folder's record keeps what its checkpoints hold
            write_record(out, record)
            return None
        check_resumed_folder(cfg, out, sweep_dir, record)
        # the folder, not the text of hydra.sweep.dir: a resume that spells it otherwise (`.`, relative to the date
        # folder) is the same group
        sweep_tracking(cfg, sweep_dir, hc.job.num)
        permits = int(cfg.cluster.get("max_concurrent", 0) or 0)
        with job_slot(slots_name(sweep_dir, record["sweep_id"]), permits) as waited:
            record["queued_seconds"] = waited
            # Written now too: a job whose process is killed leaves this record (roll_core.sweep_launcher marks it
            # and takes its wall time from started_at: wall-clock seconds, comparable across the job's and driver's
            # process)
            record.update(pid=os.getpid(), host=socket.gethostname(), started_at=time.time())
            write_record(out, record)
            t_run = time.perf_counter()
            try:
                summary = run(cfg)
            finally:
                record["wall_seconds"] = time.perf_counter() - t_run
        signum = summary.get("stopped_by_signal") if isinstance(summary, dict) else None
        if signum:  # a single run exits 128+N for this: the job did not finish, its numbers are early ones
            log.error("sweep job %s was stopped by signal %s", hc.job.num, signum)
            record.update(status="stopped", summary=summary, error=f"stopped by signal {signum}")
            if str(sweep_dir) in _sweeps:
                # This process runs the sweep (basic launcher): the signal was meant for the sweep, not one job. A Ray
                # job's worker is not the sweep's process (and may run a later job): the driver's stop ends those
                # (roll_core.sweep_launcher).
                stop_sweep(sweep_dir, int(signum), f"the sweep was stopped by signal {signum} during job {hc.job.num}")
        else:
            record.update(status="ok", summary=summary)
            late = summary.get("late_signal") if isinstance(summary, dict) else None
            if late and str(sweep_dir) in _sweeps:  # in its last step: the job is complete, the sweep stops (as above)
                why = f"the sweep was stopped by signal {late} at the end of job {hc.job.num}"
                stop_sweep(sweep_dir, int(late), why)
    except KeyboardInterrupt as exc:
        # A signal while the job was built (run_control.StoppedWhileBuilding), a second one aborting it, or a Ray
        # cancel reaching a job that waits for its slot: the job is stopped, not failed, and in the sweep's process
        # the sweep stops with it. Raised on, it skipped the sweep's summary and left this record `running`.
        signum = int(getattr(exc, "signum", None) or signal.SIGINT)
        why = str(exc).split(":")[0] or f"interrupted by signal {signum}"  # "stopped while building the pipeline (..)"
        if "started_at" not in record:
            why = f"not started: {why}"
        log.error("sweep job %s: %s", hc.job.num, why)
        record.update(status="stopped", error=why)
        if sweep_dir is not None and str(sweep_dir) in _sweeps:
            stop_sweep(sweep_dir, signum, f"the sweep was stopped by signal {signum} during job {hc.job.num}")
    except Exception as exc:  # one job's failure must not stop the sweep
        log.error("sweep job %s failed: %s", hc.job.num, exc)
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    record["total_seconds"] = time.perf_counter() - t0
    write_record(dest, record)
    return job_value(record)


def _unstarted_trial(hc: Any, out: Path, sweep_dir: Path) -> sweep_stop.UnstartedTrial:
    """The answer to an Optuna trial the sweeper asked after the sweep in `sweep_dir` (run in this process) was
    stopped: not started, no record; its folder `out` (Hydra made it before the job) is removed when the sweep ends,
    which reading the answer's value does (`end_at_unstarted_trial`)."""
    signum, why = _stopped[str(sweep_dir)]
    log.error("sweep trial %s is not started (%s): told nothing, none asked after it", hc.job.num, why)
    subdir = hc.get("output_subdir")
    _unstarted.setdefault(str(sweep_dir), []).append((out, str(subdir) if subdir else None, f"{hc.job.name}.log"))
    return sweep_stop.UnstartedTrial(int(hc.job.num), lambda: end_at_unstarted_trial(sweep_dir, signum))


def end_at_unstarted_trial(sweep_dir: Path, signum: int) -> NoReturn:
    """End the sweep in `sweep_dir` that signal `signum` stopped when its sweeper reads the value of a trial it asked
    after the stop: remove the folders Hydra made for such trials, then summarise it and raise SweepStopped
    (`end_stopped_sweep`; a sweep already ended this way is not counted again)."""
    for job_dir, subdir, log_name in _unstarted.pop(str(sweep_dir), []):
        sweep_stop.remove_unstarted_folder(job_dir, subdir, log_name, sweep_dir)
    if str(sweep_dir) in _unfinished:
        end_stopped_sweep(sweep_dir, signum)
    sweep_stop.exit_stopped(sweep_dir, signum, sweep_job_records(sweep_dir))


def job_value(record: dict[str, Any]) -> float | None:
    """What a sweeper gets for a job record: its final held-out accuracy when it is `ok` and finite, else None (a
    sweeper must not rank a failed or cut-short job by its partial accuracy). None, not NaN: the Optuna sweeper
    records a failed trial for a value float() refuses, while a NaN reached Optuna's `tell`, which raised out of
    the sweeper (the sweep ended at that batch, without its summary)."""
    value = (record.get("summary") or {}).get("final_eval_accuracy") if record.get("status") == "ok" else None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    if record.get("status") == "ok":
        log.error(
            "sweep job %s finished without a finite final held-out accuracy (%r): a failed trial for a sweeper (%s)",
            record.get("job"),
            value,
            _no_final_accuracy(record, value),
        )
    return None


def _no_final_accuracy(record: dict[str, Any], value: Any) -> str:
    """Why an `ok` job has no finite final accuracy: a stop skipped it (summary's `skipped`), NaN, its last
    evaluation attempted nothing (eval/n 0, no accuracy: roll_core.eval_history), or none logged."""
    summary = record.get("summary") or {}
    final = [str(s) for s in summary.get("skipped") or [] if str(s).startswith("final eval")]
    if final:
        return f"a stop skipped its {final[0]}: roll-eval its last checkpoint for it"
    if value is not None:
        return "the evaluation gave a non-finite accuracy"
    # evaluations that attempted nothing were blamed on pipeline.eval_every=0, which the job did not set
    why = no_outcome_in(summary.get("output_dir"))
    if why is None and summary.get("best_eval_accuracy") is not None:  # its metrics.jsonl unread: an earlier had one
        why = "last evaluation had no outcome (eval/n 0)"
    if why is not None:
        return f"its {why}: no held-out episode was attempted; the job's log says why"
    return "no held-out evaluation was logged: pipeline.eval_every=0 evaluates nothing"


def job_sweep_dir(hc: Any) -> Path:
    """A job's sweep folder as an absolute path. Hydra changes a job's working directory to its own folder
    before the job runs when `hydra.job.chdir=true` (off by default with version_base=None), so a relative
    `hydra.sweep.dir` (the default multirun/<date>/<time>) is taken from the directory the sweep was started in
    (`hydra.runtime.cwd`)."""
    cwd = hc.runtime.get("cwd") or os.getcwd()  # always set by Hydra; a hand-made config may lack it
    return Path(str(cwd), str(hc.sweep.dir)).resolve()


def start_sweep(sweep_dir: str | Path) -> dict[str, Any]:
    """Write `sweep_id.json` (a new id and the start time) into the sweep folder and remember it in this process;
    returns it. A sweep run again into the same folder replaces it: the folder's records of earlier sweeps become
    stale."""
    import uuid

    folder = Path(sweep_dir).resolve()
    marker = {"sweep_id": uuid.uuid4().hex, "started_at": time.time()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SWEEP_FILE).write_text(json.dumps(marker, indent=2))
    _sweeps[str(folder)] = marker
    _unfinished.add(str(folder))
    _stopped.pop(str(folder), None)  # an earlier sweep's stop into the same folder does not stop this one
    return marker


def stop_sweep(sweep_dir: str | Path, signum: int, why: str) -> None:
    """Mark the sweep in `sweep_dir` stopped by signal `signum` (the first stop counts): its later jobs are not
    started (`why` says so in their records) and roll-train exits 128 + `signum` once it is summarised."""
    _stopped.setdefault(str(Path(sweep_dir).resolve()), (int(signum), why))


def stop_signal(sweep_dir: str | Path) -> int | None:
    """The signal that stopped the sweep in `sweep_dir` in this process, or None."""
    stop = _stopped.get(str(Path(sweep_dir).resolve()))
    return stop[0] if stop else None


def sweep_marker(sweep_dir: str | Path) -> dict[str, Any]:
    """The sweep folder's `sweep_id.json` ({} when there is none: a folder of an older roll, or no callback):
    this process's own when it started the sweep, else the file's."""
    folder = Path(sweep_dir).resolve()
    if str(folder) in _sweeps:
        return _sweeps[str(folder)]
    try:
        marker = json.loads((folder / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def summarize(sweep_dir: str | Path, sweep_id: str | None = None) -> list[dict[str, Any]]:
    """Collect the jobs of a sweep folder and write summary.csv, summary.md and rewards.png; returns the rows, in
    job order. `sweep_id`: the sweep whose jobs to summarise (default: the folder's sweep_id.json, the latest sweep
    run into it; a folder without one: every record)."""
    sweep_dir = Path(sweep_dir)
    marker = sweep_marker(sweep_dir)
    sweep_id = sweep_id or marker.get("sweep_id")
    found, _ = job_records(sweep_dir, sweep_id, marker.get("started_at") if sweep_id else None)
    return write_summary(sweep_dir, found)


class SweepSummaryCallback(Callback):
    """Hydra callback: before a multirun, mark its sweep folder with a new sweep id and, on the Ray launcher, start
    its local Ray instance on loopback, and, for an Optuna sweeper, keep its study and number a continued study's jobs
    after its trials (roll_core.sweep_optuna.watch_sweep) and make its SQL storage one Optuna 2.x opens under
    SQLAlchemy 2; after it, count its failed jobs for the exit code and summarise its jobs."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        start_sweep(config.hydra.sweep.dir)
        try:
            start_sweep_ray(config.hydra.launcher)
        finally:  # after ray.init, which installs Ray's SIGTERM handler (an abort, no summary); also if it failed
            sweep_stop.install()
        watch_sweep(config.hydra.sweep.dir, config.hydra.get("sweeper"))  # never raises
        # last: Hydra turns a callback's exception into a warning; one here must not skip the steps above
        prepare_study_storage(config.hydra.get("sweeper"))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        signum = stop_signal(sweep_dir)
        if signum is None:
            end_sweep(sweep_dir)
        else:  # SystemExit, not Exception: Hydra does not turn it into a warning
            end_stopped_sweep(sweep_dir, signum)


def sweep_job_records(sweep_dir: str | Path) -> tuple[list[tuple[Path, dict[str, Any]]], list[str]]:
    """`job_records` of the latest sweep run into `sweep_dir` (its sweep_id.json; a folder without one: every
    record, none left out as older than the sweep)."""
    marker = sweep_marker(sweep_dir)
    sweep_id = marker.get("sweep_id")
    return job_records(sweep_dir, sweep_id, marker.get("started_at") if sweep_id else None)


def end_stopped_sweep(sweep_dir: Path, signum: int) -> NoReturn:
    """End the sweep in `sweep_dir` that signal `signum` stopped: count its failures and write its summary
    (`end_sweep`), then raise roll_core.sweep_stop.SweepStopped (exit 128 + `signum`) with the line that says what
    its jobs did, from the same read of its job records."""
    try:
        records: tuple[list[tuple[Path, dict[str, Any]]], list[str]] | None = sweep_job_records(sweep_dir)
    except Exception:  # end_sweep reads them again and counts what it cannot read as a failure
        records = None
    end_sweep(sweep_dir, records)
    sweep_stop.exit_stopped(sweep_dir, signum, records)


def end_sweep(sweep_dir: Path, records: tuple[list[tuple[Path, dict[str, Any]]], list[str]] | None = None) -> list[str]:
    """Count the failed jobs of the sweep in `sweep_dir` (for the exit code, `failed_jobs`) and write its summary;
    returns its failures. Run by `SweepSummaryCallback.on_multirun_end` and, for a sweep whose sweeper raised
    (Hydra then skips on_multirun_end), by `end_unfinished_sweeps`, which passes the sweep's `job_records` it has
    already read as `records` (None: read them here)."""
    _unfinished.discard(str(sweep_dir.resolve()))
    if not _unfinished:
        sweep_stop.restore()
    unwatch()  # an Optuna sweeper's study wrappers (sweep_optuna.watch_sweep), when its sweep() never ran
    remove_slots(sweep_dir)
    # Failures first, from the records alone: Hydra turns an exception raised here into a warning, and a
    # summary that fails to write must not also make roll-train exit 0 over failed jobs.
    try:
        if records is None:
            records = sweep_job_records(sweep_dir)
        found, failed = records
        records = [st for _, st in found]
        failed = [label for st, label in zip(records, job_labels(records)) if st.get("status") != "ok"] + failed
        if not found and not failed:  # every multirun launches a job: finding none means its record was lost
            failed.append(f"no {STATUS_FILE} of this sweep found under {sweep_dir}")
            log.error("sweep: no job record (%s) of this sweep found under %s", STATUS_FILE, sweep_dir)
    except Exception as exc:
        found, failed = [], [f"could not read the job records under {sweep_dir}: {type(exc).__name__}: {exc}"]
        log.exception("sweep: could not read the job records under %s", sweep_dir)
    _failed_jobs.extend(failed)
    try:
        write_summary(sweep_dir, found)
    except Exception:
        log.exception("sweep: could not write the summary of %s (the failures are still counted)", sweep_dir)
    # "not ok": stopped and not-started jobs count too (roll-train exits non-zero), as more than "failed"
    log.info("sweep summary: %d jobs, %d not ok -> %s/summary.md", len(found), len(failed), sweep_dir)
    if failed:
        log.error("jobs not ok (failed, killed, stopped): %s", "; ".join(failed))
    return failed


def end_unfinished_sweeps(exc: BaseException) -> list[tuple[Path, list[str]]]:
    """Summarise the sweeps started in this process that an exception `exc` ended before Hydra's on_multirun_end
    (the sweeper raised: hydra-optuna-sweeper asks the study for its best trial when every trial failed, and
    Optuna raises "No trials are completed yet"): the user gets the summary of what failed, not just a traceback.
    Returns (summary.md, the sweep's failures) per sweep; none when no sweep was left unfinished. A sweep a signal
    stopped (roll_core.sweep_stop) has its jobs still `running` recorded as `stopped` and ends roll-train with
    SystemExit(128 + N) once summarised."""
    ended = []
    stopped: list[tuple[Path, int, tuple[list[tuple[Path, dict[str, Any]]], list[str]]]] = []
    for folder in sorted(_unfinished):
        found, problems = sweep_job_records(folder)  # read once, handed to end_sweep and the stop's report
        if not found and not problems:  # it stopped before any job ran (a sweeper that cannot be made): no summary
            _unfinished.discard(folder)
            unwatch()
            continue
        signum = stop_signal(folder)
        if signum is not None:
            sweep_stop.mark_unended(found, signum)
            stopped.append((Path(folder), signum, (found, problems)))
        log.error("sweep %s stopped with %s: %s; summarising the jobs it ran", folder, type(exc).__name__, exc)
        ended.append((Path(folder) / "summary.md", end_sweep(Path(folder), (found, problems))))
    if not _unfinished:
        sweep_stop.restore()
    if stopped:
        sweep_stop.exit_stopped(*stopped[0])
    return ended


def start_sweep_ray(launcher: Any) -> bool:
    """Start the Ray launcher's local instance (`hydra.launcher.ray.init` without an address) the way `Cluster`
    starts one: listening on loopback only (`loopback_only`). The launcher then finds Ray running and uses it.
    Returns whether it started one; another launcher, an `init.address` to join, or a running Ray: nothing."""
    from omegaconf import OmegaConf

    if not str(launcher.get("_target_", "")).endswith(".RayLauncher"):  # hydra-ray-launcher's or roll's
        return False
    init = OmegaConf.to_container(launcher.ray.init, resolve=True)
    assert isinstance(init, dict)
    if init.pop("address", None):
        return False
    import ray

    if ray.is_initialized():
        return False
    from roll_core.cluster.launch import loopback_only, own_session

    with loopback_only(), own_session():  # out of the driver's process group: a `kill -TERM -<pgid>` stops jobs cleanly
        ray.init(address="local", _node_ip_address="127.0.0.1", **init)
    log.info("sweep: started a local Ray instance on loopback (hydra.launcher.ray.init.address=auto joins a cluster)")
    return True


def remove_slots(sweep_dir: str | Path) -> None:
    """Remove the sweep's `JobSlots` actor (detached: it outlives the driver on a cluster joined with
    `init.address`): at the sweep's end, and by roll's Ray launcher when the sweep is aborted (Ctrl-C), since Hydra
    then skips `on_multirun_end`. Bookkeeping only: a failure is logged, never raised."""
    try:
        import ray
    except ImportError:
        return
    if not ray.is_initialized():
        return
    name = slots_name(sweep_dir, sweep_marker(sweep_dir).get("sweep_id"))
    try:
        ray.kill(ray.get_actor(name, namespace=SLOTS_NAMESPACE))
    except ValueError:  # no slots actor: the sweep ran without max_concurrent
        pass
    except Exception as exc:  # the failures and the summary must still be counted and written
        log.warning("could not remove the sweep slots of %s: %s", sweep_dir, exc)


def failed_jobs() -> list[str]:
    """The jobs that were not `ok` (failed, killed, stopped by a signal, still `running`: their swept overrides) or
    whose record is missing or unreadable, in this process's sweeps."""
    return list(_failed_jobs)
