"""The Ray launcher of roll's sweeps (`hydra/launcher=ray`: hydra_plugins.roll_ray_launcher.RayLauncher, where Hydra
looks for plugins): hydra-ray-launcher's, where a job whose process dies does not take the sweep down with it.

hydra-ray-launcher collects its jobs with `ray.get` one after another: a job killed outright (SIGKILL, the OOM
killer, a lost node) raised out of the launcher, Hydra skipped the multirun's end (no summary.csv, no rewards.png)
and the jobs still running were abandoned with the driver. Jobs that raise are already caught inside the job
(roll_core.sweep.run_sweep_job); this launcher handles the ones that cannot catch anything:

- every job is waited for, whatever happened to the others;
- a job whose process died is recorded as `killed` in its folder's `job_status.json` (with Ray's reason, the
  sweep's id, and as its `wall_seconds` the time from its start record to when the launcher saw it die; none when
  it died before writing one) and returned to Hydra as a completed job whose value is None, so the sweeper goes on
  (Optuna records a failed trial) and `SweepSummaryCallback` summarises it with the others; `roll-train` exits
  non-zero;
- a job that had already written its end record (ok, failed, stopped) when Ray lost it keeps that record;
- jobs are collected as they end (`ray.wait`), not in launch order, so a job's death is seen when it happens, not
  when the jobs launched before it have finished;
- jobs that give `cluster.max_concurrent` different values (a sweep of it) are refused before any starts: it is
  the sweep's bound, held by one slots actor (roll_core.sweep_slots.job_slot);
- jobs that would share a folder (a `hydra.sweep.subdir` that two jobs resolve alike, e.g. the override_dirname of
  a repeated value) are refused before any starts: they wrote one metrics.jsonl and one job_status.json, in this
  batch or over an earlier batch's finished job;
- GPUs reserved for the job's own task (`hydra.launcher.ray.remote.num_gpus`) with `cluster=ray` are refused
  before any job starts: the job's RL roles reserve their own GPUs in placement groups, so the task's sat idle and
  the roles could wait for them until cluster.placement_timeout_s;
- a sweep stopped by a signal to the driver (Ctrl-C, a scheduler's SIGTERM: roll_core.sweep_stop marks it)
  cancels its jobs the gentle way: a running job gets a SIGINT, so its GracefulStop saves a checkpoint and it ends
  `stopped`; one waiting for its slot ends `stopped` ("not started"). They are waited for and the ones that left no
  end record are recorded `stopped` too, the sweep is summarised (Hydra skips on_multirun_end) and the launcher
  raises SystemExit(128 + N): roll-train exits 128 + N, and no later batch (an Optuna sweeper's) is launched; a
  batch the sweeper hands over after a stop between batches is not launched either (its jobs recorded `stopped`,
  "not started": it was launched and cancelled half a second later, so its jobs could start after the stop). A
  second signal aborts: the jobs are killed (Ray's force cancel), recorded `stopped` and summarised. Either way
  the exit is roll_core.sweep_stop.SweepStopped, whose line roll-train prints (what the jobs did). Before, a
  SIGINT left the jobs `running` and no summary, and a SIGTERM aborted the driver (Ray's handler: a stack dump,
  exit -6) with the jobs abandoned;
- a sweep aborted while its jobs run removes its detached slots actor: Hydra skips `on_multirun_end`;
- an error in the driver after jobs started (a later job's launch failed, the wait raised) asks the jobs still
  running to stop the gentle way (a SIGINT: a checkpoint, `stopped`) for up to ERROR_GRACE_S, then kills the rest
  (Ray's force cancel) and records them (`failed` with the error); a KeyboardInterrupt with no stop mark kills them
  at once (`stopped`). Either way the summary is written and the error raised on. Before, they ran on unbounded
  (the slots actor removed) until the driver exited, with no record and no summary; then they were killed at once,
  losing every step since their last checkpoint;
- a killed job is recorded once its process is gone (waited for up to KILL_WAIT_S): a job ending meanwhile wrote
  its own end record over the launcher's;
- jobs whose config roll refuses (an unknown key forced in with `+key=`, a value a schema's check refuses, e.g.
  `algo.lr=1e-3,-1`) are refused before any starts, naming the job (roll_core.sweep_checks): each job checked its
  own config when it ran, so a sweep whose one value was bad failed that job after the ones before it had trained;
- a job's own Ray task asking for more than any node of a Ray instance started here has (`hydra.launcher.ray.remote`
  num_gpus on a machine without GPUs, num_cpus over its cores) is refused before any starts: Ray keeps an infeasible
  task pending forever, so the sweep hung with no error (on a joined cluster, which an autoscaler may grow, a
  warning);
- jobs are not retried by Ray (`remote.max_retries: 0` in conf/hydra/launcher/ray.yaml): a retried job would find
  its own checkpoints in its folder and be refused, and an out-of-memory job would usually die again.

Launch: roll-train -m algo.lr=1e-6,3e-6 hydra/launcher=ray
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra_plugins.hydra_ray_launcher._launcher_util import launch_job_on_ray, start_ray
from omegaconf import DictConfig, OmegaConf, open_dict

from roll_core import sweep_stop
from roll_core.errors import ConfigError
from roll_core.sweep import (
    STATUS_FILE,
    end_stopped_sweep,
    end_sweep,
    job_value,
    remove_slots,
    stop_signal,
    sweep_marker,
    write_record,
)
from roll_core.sweep_checks import check_job_configs, check_job_resources
from roll_core.sweep_resume import record_folder_run

log = logging.getLogger(__name__)

ERROR_GRACE_S = 120.0  # after a launcher error: how long its jobs get to save a checkpoint and stop before a kill
KILL_WAIT_S = 15.0  # how long a killed job's process gets to be gone before the launcher records the job


def launch_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    """Start every job as a Ray task (hydra-ray-launcher's way), wait for all of them, record the killed ones.
    `launcher`: the RayLauncher (its `ray_cfg`, `config`, `hydra_context` and `task_function`)."""
    import ray

    setup_globals()
    assert launcher.config is not None and launcher.hydra_context is not None
    assert launcher.task_function is not None
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log.info("Ray launcher: %d jobs, sweep folder %s", len(job_overrides), sweep_dir)
    cfgs: list[DictConfig] = []
    for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id = f"job_id_for_{idx}"  # set for real on the worker (a scheduler's id)
            cfg.hydra.job.num = idx
        cfgs.append(cfg)
    stopped = stop_signal(sweep_dir)
    if stopped is not None:  # between batches (the sweeper asking its next trials): no job starts after a stop
        log.warning("sweep stopped by signal %s: its next %d job(s) are not started", stopped, len(cfgs))
        for cfg, overrides in zip(cfgs, job_overrides):
            killed(cfg, list(overrides), KeyboardInterrupt("the sweep was stopped before they were launched"), stopped)
        end_stopped_sweep(sweep_dir, stopped)
    jobs: list[tuple[DictConfig, list[str], Any]] = []
    results: list[JobReturn | None] = []
    stopping: int | None = None  # the signal that stopped the sweep, once its jobs were asked to stop
    try:
        # Before any job of this batch starts; a refused later batch (an Optuna sweeper's) also removes the slots
        # actor its earlier batches' jobs created
        check_max_concurrent(launcher, cfgs)
        check_job_folders(launcher, cfgs)
        check_job_gpus(launcher, cfgs)
        check_job_configs(cfgs, job_overrides)
        start_ray(launcher.ray_cfg.init)
        sweep_stop.rearm()  # a Ray started here replaced the sweep's SIGTERM handler with its own (an abort)
        check_job_resources(launcher)
        for cfg, overrides in zip(cfgs, job_overrides):
            log.info("\t#%d : %s", cfg.hydra.job.num, " ".join(filter_overrides(overrides)))
            ref = launch_job_on_ray(
                launcher.hydra_context, launcher.ray_cfg.remote, cfg, launcher.task_function, Singleton.get_state()
            )
            jobs.append((cfg, list(overrides), ref))
        # Collected as they end: killed() takes a dead job's wall time from the moment its death is seen, which in
        # launch order would wait for every job launched before it.
        results = [None] * len(jobs)
        pending = {ref: i for i, (_, _, ref) in enumerate(jobs)}
        while pending:
            # With a timeout: a stop signal only marks the sweep (roll_core.sweep_stop), seen here
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            if stopping is None and stop_signal(sweep_dir) is not None:
                stopping = stop_signal(sweep_dir)
                log.warning("sweep stopped by signal %s: asking its %d job(s) running to stop", stopping, len(pending))
                for ref in pending:
                    ray.cancel(ref)  # not forced: a SIGINT in the job's process (its GracefulStop: a checkpoint)
            for ref in ready:
                i = pending.pop(ref)
                cfg, overrides, _ = jobs[i]
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayError as exc:  # its process died (or was cancelled): it could not catch it
                    results[i] = killed(cfg, overrides, exc, stopping)
    except BaseException as exc:  # a second signal, a refused batch: Hydra skips on_multirun_end (and its slots' end)
        stopping = stopping or stop_signal(sweep_dir)
        unended = [job for i, job in enumerate(jobs) if i >= len(results) or results[i] is None]
        if isinstance(exc, KeyboardInterrupt) and stopping is None and unended:  # Ctrl-C without roll's handlers
            stopping = int(getattr(exc, "signum", None) or signal.SIGINT)
        if stopping is not None or unended:
            # An abort, or an error (a later job's launch failed, the wait raised) after jobs started: they are stopped
            # (an error: at a checkpoint first) and recorded (stopped, or failed with the error) unless they had ended;
            # without this they ran on, with no slots actor bounding them, until the driver exited, and the summary
            # was never written.
            end_unended(unended, exc, stopping)
            if stopping is not None and isinstance(exc, SystemExit):  # the second signal's: with the stop's line
                end_stopped_sweep(sweep_dir, stopping)
            end_sweep(sweep_dir)  # Hydra skips on_multirun_end
        remove_slots(sweep_dir)
        raise
    if stopping is not None:  # the sweep ends here: no later batch (an Optuna sweeper's) starts
        end_stopped_sweep(sweep_dir, stopping)
    return [r for r in results if r is not None]


def end_unended(unended: Sequence[tuple[DictConfig, list[str], Any]], exc: BaseException, stopping: int | None) -> None:
    """End and record the jobs the launcher no longer waits for. After an error in the driver (`stopping` None) they
    are first asked to stop the gentle way (a SIGINT: GracefulStop saves a checkpoint and the job ends `stopped`, so a
    resumed sweep loses nothing) for up to ERROR_GRACE_S; force-killed right away they lost every step since their
    last checkpoint. An abort (a second signal) kills them at once. Every kill is waited for (up to KILL_WAIT_S)
    before the job is recorded: `ray.cancel` returns before the process is gone, and a job ending meanwhile wrote its
    own end record after (over) the launcher's, so its folder and the summary disagreed."""
    left = [ref for _, _, ref in unended]
    if stopping is None and left:
        log.warning(
            "the sweep's launcher raised %s: asking its %d job(s) still running to stop at a checkpoint (up to %.0f s)",
            type(exc).__name__,
            len(left),
            ERROR_GRACE_S,
        )
        for ref in left:
            _cancel(ref, force=False)
        left = _wait_ended(left, ERROR_GRACE_S)
    for ref in left:
        _cancel(ref, force=True)
    _wait_ended(left, KILL_WAIT_S)
    for cfg, overrides, _ in unended:
        try:  # a job that ended by itself (its own end record: ok, stopped at a checkpoint) keeps its record
            if stopping is not None:
                killed(cfg, overrides, KeyboardInterrupt("the sweep was aborted"), stopping)
            else:
                killed(cfg, overrides, exc, aborted=True)
        except Exception:  # the error raised on is `exc`; the summary counts a job left `running` as failed
            log.exception("could not record sweep job %s", cfg.hydra.job.num)


def _cancel(ref: Any, force: bool) -> None:
    import ray

    try:
        ray.cancel(ref, force=force)
    except Exception as cancel_exc:  # the others must still be cancelled and every job recorded
        log.warning("could not cancel a sweep job (force=%s): %s", force, cancel_exc)


def _wait_ended(refs: list[Any], timeout_s: float) -> list[Any]:
    """The refs still running after up to `timeout_s`; all of them when the wait itself fails or is interrupted (a
    second signal during the grace: the jobs are then killed)."""
    import ray

    if not refs:
        return []
    try:
        _, left = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    except BaseException as wait_exc:  # the launcher's own error is raised on by the caller
        log.warning("stopped waiting for %d sweep job(s) to end: %s", len(refs), type(wait_exc).__name__)
        return list(refs)
    return list(left)


def check_max_concurrent(launcher: Any, cfgs: Sequence[DictConfig]) -> None:
    """Refuse jobs that give `cluster.max_concurrent` different values (a sweep of it, or of a config group that
    sets it): it is the sweep's bound on jobs at once, held by one `JobSlots` actor the first job creates, so all but
    one value would be silently ignored. Checked against the sweep's earlier batches too (the launcher keeps it)."""
    values = {int(OmegaConf.select(c, "cluster.max_concurrent", default=0) or 0) for c in cfgs}
    earlier = getattr(launcher, "_roll_max_concurrent", None)
    if earlier is not None:
        values.add(earlier)
    if len(values) > 1:
        raise ConfigError(
            "cluster.max_concurrent is a setting of the whole sweep (how many of its jobs run at once), not of a job: "
            f"its jobs give {', '.join(map(str, sorted(values)))}. Give it one value (cluster.max_concurrent=2), not "
            "a sweep of values (cluster.max_concurrent=1,2)"
        )
    if values:
        launcher._roll_max_concurrent = next(iter(values))


def job_folder(cfg: DictConfig) -> Path:
    """Job `cfg`'s folder as Hydra's run_job makes it: hydra.sweep.dir / hydra.sweep.subdir."""
    num = int(cfg.hydra.job.num)
    return Path(str(cfg.hydra.sweep.dir)) / str(OmegaConf.select(cfg, "hydra.sweep.subdir", default=num))


def check_job_folders(launcher: Any, cfgs: Sequence[DictConfig]) -> None:
    """Refuse jobs whose folders coincide, with each other or with a job of the sweep's earlier batches (the
    launcher keeps them): two jobs in one folder write one metrics.jsonl, and the later job_status.json replaces the
    earlier job's record, so the summary loses a job."""
    seen: dict[str, int] = dict(getattr(launcher, "_roll_job_folders", {}))
    for cfg in cfgs:
        folder, num = str(job_folder(cfg).resolve()), int(cfg.hydra.job.num)
        if folder in seen:
            raise ConfigError(
                f"sweep jobs {seen[folder]} and {num} would write into the same folder {folder} (hydra.sweep.subdir): "
                "give every job its own, e.g. hydra.sweep.subdir=${hydra.job.num} (the default) or "
                "hydra.sweep.subdir=${hydra.job.num}_${hydra.job.override_dirname}"
            )
        seen[folder] = num
    launcher._roll_job_folders = seen


def check_job_gpus(launcher: Any, cfgs: Sequence[DictConfig]) -> None:
    """Refuse GPUs reserved for the job's own Ray task when its roles are Ray actors (`cluster.backend=ray`): they
    reserve their GPUs themselves (hw.*), so the task's would sit idle while the roles wait for free ones. With
    `cluster=local` the roles run in the task, and `remote.num_gpus` is what gives each job its own GPUs."""
    gpus = OmegaConf.select(launcher.ray_cfg, "remote.num_gpus", default=0) or 0
    ray_jobs = [int(c.hydra.job.num) for c in cfgs if OmegaConf.select(c, "cluster.backend", default=None) == "ray"]
    if float(gpus) > 0 and ray_jobs:
        raise ConfigError(
            f"hydra.launcher.ray.remote.num_gpus={gpus} reserves GPUs for each sweep job's own Ray task, but with "
            "cluster=ray the job's RL roles reserve their own GPUs (hw.*) and the task's sit idle: the roles may "
            "never be placed. Drop it, and bound the jobs at once with cluster.max_concurrent=N (or use "
            "cluster=local, where the roles run in the job's task and remote.num_gpus gives each job its GPUs)"
        )


def killed(
    cfg: DictConfig, overrides: list[str], exc: BaseException, stopped: int | None = None, aborted: bool = False
) -> JobReturn:
    """Record job `cfg` as killed (its folder's job_status.json) and the JobReturn Hydra gets for it. A job that had
    written its end record (ok, failed, stopped) before Ray lost it (its process died on its way out, its result
    was lost with its node) keeps that record, and the sweeper gets the value it would have returned. `stopped`:
    the signal that stopped the sweep (its jobs were cancelled): the job is recorded `stopped`, not `killed`.
    `aborted`: the launcher cancelled it because `exc` was raised in the driver: recorded `failed`, with that error."""
    num = int(cfg.hydra.job.num)
    folder = job_folder(cfg)
    reason = str(exc).strip().splitlines()
    error = f"{type(exc).__name__}: {reason[0] if reason else ''}".rstrip(": ")
    record: dict[str, Any] = {}
    try:  # what the job wrote when it started (its slot wait, process id)
        record = json.loads((folder / STATUS_FILE).read_text())
    except (OSError, ValueError):
        pass
    sweep_id = sweep_marker(str(cfg.hydra.sweep.dir)).get("sweep_id")
    if not isinstance(record, dict) or (sweep_id is not None and record.get("sweep_id") != sweep_id):
        record = {}  # an earlier sweep's record in the same folder: this job died before writing its own
    value = None
    if sweep_id is not None and record.get("status") not in (None, "running"):  # this sweep's end record
        status = record["status"]
        log.warning("sweep job %d had ended (%s) when Ray lost it (%s): its record is kept", num, status, error)
        value = job_value(record)
    else:
        started = isinstance(record.get("started_at"), (int, float))
        if stopped is not None:  # cancelled by the sweep's stop: the sweep's summary says stopped, not killed
            why = "the sweep was stopped while it ran" if started else "not started: the sweep was stopped"
            log.error("sweep job %d: %s (%s)", num, why, error)
            record.update(job=num, overrides=overrides, status="stopped", error=f"stopped by signal {stopped}: {why}")
        elif aborted:  # the driver's error, not the job's: the job was cancelled with the sweep
            why = "cancelled while it ran" if started else "not started"
            log.error("sweep job %d: %s: the sweep's launcher raised %s", num, why, error)
            record.update(job=num, overrides=overrides, status="failed", error=f"{why}: the sweep raised {error}")
        else:
            log.error("sweep job %d was killed (%s); the sweep goes on", num, error)
            record.update(job=num, overrides=overrides, status="killed", error=error)
        folder.mkdir(parents=True, exist_ok=True)
        if started:  # it ran until now (wall clock: its own process)
            record["wall_seconds"] = max(0.0, time.time() - record["started_at"])
        else:  # killed before it wrote its start record: unknown, shown as "-" (not 0)
            record["wall_seconds"] = None
        record["sweep_id"] = sweep_id  # also without a start record: it is this sweep's job
        record_folder_run(folder, record)  # a resumed folder's record keeps what its checkpoints hold
        write_record(folder, record)
    return JobReturn(
        overrides=overrides,
        cfg=cfg,
        working_dir=str(folder),
        task_name=str(OmegaConf.select(cfg, "hydra.job.name", default="")),
        status=JobStatus.COMPLETED,  # a FAILED return makes Hydra's sweeper raise: the summary would be lost
        _return_value=value,
    )
