"""One loop for every pipeline: next batch, update, sync, log, checkpoint.

`Pipeline(cfg)` wires a run: its folder, cluster, tokenizer, task, the collector that `pipeline.name` names (a
`roll.collectors` entry point: `rlvr`, `agentic`, `sft`, `dpo`, `distill`, `rollout`, ... or a plugin), the
objective that collector names (`roll.objectives`: `rl`, `sft`, `dpo`, ...), the training-side roles that
objective needs (`build_roles`) and the `Trainer`. `run()` trains for the remaining steps and returns the summary.
A pipeline kind is a collector and an objective, never a subclass of this class and never an `if async` in the
loop: asynchronous collection is the collector's business. Collectors that do not sample from the policy every
step (`on_policy = False`: files of SFT or preference rows) get the new weights only before they evaluate.

Run folder: one process at a time (roll_core.run_lock): a second process building a pipeline on a folder another
one holds gets a ConfigError naming the holder, before it starts or writes anything. It is made absolute here, against
the driver's working directory (as are `pipeline.resume_from` and the checkpoint it names): every path derived from it
and handed to a worker (checkpoint folders, the shared-filesystem marker) is absolute, never resolved against a Ray
worker's own working directory (its session folder, on another node).
Checkpoints: never written from inside a streak of non-finite steps (their weights may hold the blow-up); the
stop after `pipeline.max_nonfinite_steps` names the last checkpoint saved before the streak. A save that fails
(a full disk) deletes its partial folder and ends the run with `CheckpointError` naming the checkpoint left intact.
Steps that train nothing (the collector returned no batch, not by design: roll_core.pipelines.empty_steps) are
warned about with their reason and counted (`data/empty_steps`, the summary's `empty_steps`); after
`pipeline.max_empty_steps` in a row the step is logged and the run ends with `EmptyStepsError`.
Stops (roll_core.pipelines.run_control): a SIGINT/SIGTERM while the pipeline is built stops the build at once
(`StoppedWhileBuilding`; what was started is shut down, the lock released). From the evaluation before step 1 on, a
stop signal ends the run after the step it arrives in (saved: `stopped_by_signal`, report.md `stopped by signal N`).
One that arrives in the last step (`pipeline.max_steps`, or the step that finishes a finite job) stops nothing: the
step completes and is saved, the run is complete (`stopped_by_signal` None, exit 0, report.md `finished`, a resume
trains nothing) and the summary says what the signal skipped (`late_signal`, `skipped`: the final evaluation;
`final_eval_accuracy` is then None, `roll-eval` on the last checkpoint gives it), as do a resumed run's summary and
report.md status (the skipped steps are checkpointed; both are written by roll_core.pipelines._run_summary). One that
arrives after the last step (final curves, the trackers' close, report.md) is logged and changes nothing but
`late_signal`. A second signal aborts at once (`StopAborted`: report.md and roll-train's one line name the latest
complete checkpoint; exit 128 + N; its message and a failed save's: roll_core.pipelines._run_endings). A stop
requested before a step's evaluation skips it (with a warning): the checkpoint comes first, within a preemption's
grace period. The step that ends a run (a stop, a non-finite stop, a finished finite job) is logged; a run resumed at
or past `pipeline.max_steps`, or after its finite job was done, trains nothing and says so.
Determinism:
sampling seeds derive from (seed, purpose, step) and the collector's data position is checkpointed, so a resumed
synchronous run on CPU reproduces the uninterrupted run's metrics.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from roll_core import registry
from roll_core.algorithms import load_estimator
from roll_core.checkpoint import CheckpointError, CheckpointManager
from roll_core.cluster.launch import Cluster
from roll_core.cluster.shared_fs import check_run_folder
from roll_core.config.build import build
from roll_core.config.resume import check_checkpoint, config_dict
from roll_core.config.schema import RLVRConfig
from roll_core.models import resolve_model_path
from roll_core.pipelines._console import PROGRESS_FIELDS as PROGRESS_FIELDS  # re-exported: imported from here
from roll_core.pipelines._console import StepReport, ending_line
from roll_core.pipelines._console import progress_fields as progress_fields  # re-exported: imported from here
from roll_core.pipelines._resume_schedule import log_schedule_rebase
from roll_core.pipelines._run_endings import StopAborted, free_bytes, save_failure, signal_name
from roll_core.pipelines._run_summary import end_status, restored_skips, run_summary
from roll_core.pipelines.collectors import Collector, CollectorContext, CollectorFactory
from roll_core.pipelines.empty_steps import EmptySteps, EmptyStepsError
from roll_core.pipelines.metrics import StepLog, heavy_masking_warning
from roll_core.pipelines.objectives import load_objective
from roll_core.pipelines.run_control import (
    BuildStop,
    GracefulStop,
    named_checkpoint,
    resolve_run_folder,
    set_aside_newer,
)
from roll_core.pipelines.structured_thinking import refuse_structured_thinking
from roll_core.pipelines.template_kwargs import check_config_template_kwargs
from roll_core.pipelines.trainer import Trainer
from roll_core.pipelines.wiring import build_roles, check_train_models
from roll_core.run_lock import hold_run_folder
from roll_core.tracking import AGREEMENT_PLOT_KEYS, Tracker

log = logging.getLogger(__name__)


def _absolute(folder: str | Path) -> Path:
    """`folder` (`~` expanded) as an absolute path, a relative one taken from this process's working directory;
    not normalised (`..` after a symbolic link keeps the operating system's meaning)."""
    return Path(folder).expanduser().absolute()


class Pipeline:
    """A run: roles, a collector, a trainer, and the loop between them (see the module docstring)."""

    #: Run restarts since the last logged step (set by run_control.run_with_restarts), logged once.
    pending_run_restarts: int = 0

    def __init__(self, cfg: RLVRConfig, output_dir: str | Path | None = None) -> None:
        # A stop signal while the pipeline is built raises StoppedWhileBuilding (run_control): it had Python's default
        # meaning, a KeyboardInterrupt traceback or an outright kill leaving the shutdown below undone.
        with BuildStop() as self._building:
            try:
                self._build(cfg, output_dir)
                # A stop a library swallowed after the build's last rearm() (a checkpoint's restore, the trainer's
                # set-up) is raised here, not lost: the run trained every step and exited 0.
                self._building.check()
            except BaseException:
                # A run that fails while it is built (placement timeout, a model that does not load, a refused
                # checkpoint, a stop signal) gives back what it started: Ray, placement groups, actors, the lock. A
                # sweep's next job in this process otherwise found the leaked instance, reused it and failed.
                self.shutdown()
                raise

    def _build(self, cfg: RLVRConfig, output_dir: str | Path | None) -> None:
        pipe = cfg.pipeline
        self.cfg = cfg
        # Wall time: this process's from here (setup included), plus the earlier processes' up to the checkpoint
        # a resumed run starts from (recorded in each checkpoint's state).
        self._created, self.wall_before = time.perf_counter(), 0.0
        factory: CollectorFactory = registry.load("roll.collectors", pipe.name)
        # expanduser: a YAML or Python-API output_dir of "~/runs/a" wrote into a folder named "~" here. Absolute: the
        # trainer's Ray ranks got a relative folder as it was and wrote their shards under their own working directory.
        out = _absolute(output_dir or pipe.output_dir or Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S"))
        resume_from = str(_absolute(pipe.resume_from)) if pipe.resume_from else None
        # resume=true looks for another run only from Hydra's generated folders (no pipeline.output_dir; not a
        # multirun job, whose siblings are the other jobs of its sweep).
        search = pipe.output_dir is None and not _in_multirun()
        # One process writes a run folder (roll_core.run_lock), held until shutdown() and taken before anything is
        # written or started. A new run locks its folder before it checks that the folder holds no checkpoints (a run
        # finishing in between is seen); a resumed run's folder is known once resolved.
        fresh = not (pipe.resume or pipe.resume_from)
        if fresh:
            self.run_lock = hold_run_folder(out)
        self.out = resolve_run_folder(out, pipe.resume, resume_from, cfg.experiment, search=search)
        if not fresh:
            self.run_lock = hold_run_folder(self.out)
        objective = load_objective(getattr(factory, "objective", "rl"))
        needs = objective.needs(cfg)
        # Before Ray starts: a model the train engine cannot train was refused by its workers, once spawned.
        check_train_models(cfg, needs)
        self.cluster = Cluster(cfg.cluster, cfg.hw)
        self._building.rearm()  # ray.init replaced the SIGTERM handler with Ray's (an abort with a stack dump)
        self.cluster.platform.seed_everything(pipe.seed)
        self.model_path = resolve_model_path(cfg.model.path)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.tokenizer or self.model_path, trust_remote_code=cfg.model.trust_remote_code
        )
        # A key no chat template reads (a misspelt enable_thinking) rendered as undefined, silently ignored: the
        # model's (prompts) and those data.chat_template_kwargs adds (the file-fed pipelines' rows).
        check_config_template_kwargs(self.tokenizer, cfg, model_path=self.model_path)
        # A constraint on a template that opens <think> would constrain the reasoning: every reply cut off.
        refuse_structured_thinking(self.tokenizer, cfg, model_path=self.model_path)
        self.task = build(cfg.env)
        # Said before any model loads: a task the collector cannot use, an estimator without the batch's form.
        factory.check(cfg, self.task)
        if getattr(factory, "objective", "rl") == "rl":
            load_estimator(cfg.algo.adv_estimator, trajectories=factory.trajectories, gamma=cfg.algo.gamma)

        # Checkpoints record the config they were saved with: a resumed run's changed settings take effect (and are
        # logged) or are refused before anything is built, and config.yaml then says what is in effect.
        self.ckpt = CheckpointManager(self.out, keep_last=pipe.keep_last, config=config_dict(cfg))
        self.cluster.checkpoints = self.ckpt  # a fault roll cannot repair names the checkpoint to resume from
        named = named_checkpoint(resume_from)
        latest = named if named is not None else self.ckpt.latest() if (pipe.resume or resume_from) else None
        if latest is not None:
            for line in check_checkpoint(latest, cfg):
                log.info("changed on resume: %s", line)
            log_schedule_rebase(latest, cfg)  # a changed optimizer-step count per step: the engines re-base it
        if named is not None:  # accepted: the run continues from it, its newer checkpoints set aside
            set_aside_newer(named)
        from omegaconf import OmegaConf

        self.tracker = Tracker(
            self.out, OmegaConf.to_yaml(OmegaConf.structured(cfg)), pipe.trackers, resume=latest is not None
        )
        self.roles = build_roles(cfg, self.cluster, self.model_path, needs)
        self._building.rearm()  # an in-process engine may have installed its own handlers
        roles = self.roles
        # The trainer's ranks write their checkpoint shards into the run folder on their own nodes: before any step
        # (and before a resume reads it), every such node must see this driver's folder (Ray only; no cost on one node).
        writers = [roles.actor_train, roles.critic, *roles.critics]
        check_run_folder(self.out, writers, enabled=cfg.cluster.check_shared_fs)
        ctx = CollectorContext(
            cfg,
            self.cluster,
            roles.actor_infer,
            roles.sampling,
            self.tokenizer,
            self.task,
            self.model_path,
            self.tracker,
            train=roles.actor_train,
            teachers=roles.teachers,
        )
        self.collector: Collector = factory(ctx)
        self.empty_steps = EmptySteps(pipe.max_empty_steps)  # steps in a row without a batch: the run stops
        self.trainer = Trainer(
            cfg,
            self.roles,
            objective(cfg, self.roles, trajectories=factory.trajectories),
            placement=cfg.cluster.placement,
            platform=self.cluster.platform,
        )
        if cfg.cluster.backend == "ray":  # where every worker landed: nodes, resources, visible devices
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "placement.json").write_text(json.dumps(self.cluster.placement_report(), indent=2))
        self.start_step = 1
        self.healthy_checkpoint: Path | None = None  # the latest checkpoint saved outside a non-finite streak
        if latest is not None:
            self._restore(latest)

    # ---- the loop -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train for the remaining steps; returns a summary (final and best held-out accuracy, wall time). The run
        folder's report.md is written at the end, also when the run fails (roll_core.report)."""
        # The stop handling lasts until report.md is written: a signal after the last step (the last curves, a
        # tracker's upload at close) found the default handler back and killed a run that had finished (exit 143,
        # no report.md). There it is only logged (GracefulStop.ending).
        with GracefulStop() as stop:
            self.stop = stop  # a fault in the step a stop was asked in: no run restart (roll_core.run_control)
            try:
                summary = self._run_steps(stop)
            except KeyboardInterrupt as exc:
                # a second signal (GracefulStop raises it only after a first): one line saying what is left, 128 + N
                if not (stop.requested or stop.late_signum is not None) or isinstance(exc, StopAborted):
                    self.report(f"failed: {type(exc).__name__}: {str(exc)[:300]}", self.wall_seconds())
                    raise
                signum = stop.signum or stop.late_signum or signal.SIGINT
                aborted = StopAborted(signum, self.ckpt.latest(), steps_over=stop.ended)
                self.report(str(aborted), self.wall_seconds())
                raise aborted from exc
            except BaseException as exc:
                self._final_plot()  # up to PLOT_EVERY_S of the last steps were not drawn yet
                self.report(f"failed: {type(exc).__name__}: {str(exc)[:300]}", self.wall_seconds())
                self._close_tracker_failed()
                raise
            # stopped, finished (naming the evaluations stops skipped, earlier processes' too), or a partial job
            status = end_status(
                summary,
                self.tracker.history,
                healthy_checkpoint=getattr(self, "healthy_checkpoint", None),
                stop_checkpoint=getattr(self, "stop_checkpoint", None),
                exhausted=getattr(self.collector, "exhausted", True),
                max_steps=self.cfg.pipeline.max_steps,
            )
            # one line, worded by how the run ended (the whole summary: roll-train's JSON, the API's return value)
            ended_early = summary.get("incomplete") or summary.get("stopped_by_signal")
            log.log(logging.WARNING if ended_early else logging.INFO, "%s", ending_line(status, summary))
            summary["status"] = status
            self.report(status, summary["wall_seconds"])
        return summary

    def _final_plot(self) -> None:
        """Redraw curves.png on a failed run's way out (never raises: a plotting error must not hide the run's own).
        Only the loop's end and checkpoints force a redraw; a run failing between them kept up to PLOT_EVERY_S of
        steps out of the curves that report.md embeds."""
        try:
            self.tracker.plot(self._plot_keys(), force=True)
        except Exception as exc:
            log.warning("curves.png not redrawn after the failure: %s: %s", type(exc).__name__, exc)

    def _close_tracker_failed(self) -> None:
        """Close the tracker's backends on a failed run's way out, told that it failed (MLflow ends the run FAILED,
        W&B finishes it with exit code 1, SwanLab CRASHED) and TensorBoard flushes its writer. Only `_run_steps`
        closed them, so a failed run's were closed only by a `shutdown` the caller may not make (Python API). Never
        raises: a backend's error must not hide the run's own (logged; `close` is idempotent, so `shutdown` closes
        nothing twice)."""
        try:
            self.tracker.close(failed=True)
        except Exception as exc:
            log.error("closing the trackers after the failure failed: %s: %s", type(exc).__name__, exc)

    def wall_seconds(self) -> float:
        """The run's wall time so far: every process's, setup included (a resumed run's earlier processes up to
        its checkpoint)."""
        return self.wall_before + time.perf_counter() - self._created

    def report(self, status: str, wall_seconds: float) -> None:
        """Write the run folder's report.md (never raises)."""
        from roll_core.report import write_run_report

        write_run_report(self.out, self.cfg, status=status, wall_seconds=wall_seconds, checkpoints=self.ckpt.list())

    def _run_steps(self, stop: GracefulStop) -> dict[str, Any]:
        pipe = self.cfg.pipeline
        # The evaluation before training is inside the stop handling too: a SIGTERM there (a preemption while a
        # large benchmark runs) killed the process outright, and a Ctrl-C ended it with a traceback.
        if self.start_step == 1 and pipe.eval_every > 0:
            self.tracker.log(0, self.collector.evaluate(0))
        self.skipped_evals: list[int] = list(getattr(self, "skipped_evals", ()))  # stop-skipped evals (+restored)
        complete = False  # every step trained (to pipeline.max_steps, or the collector's job done)
        if stop.requested and self.start_step <= pipe.max_steps:
            if self.start_step == 1:
                log.warning("stopped before step 1: nothing was trained and no checkpoint was written")
            else:  # resumed: the run goes on from the checkpoint it resumed from
                self.stop_checkpoint = self.healthy_checkpoint
                log.warning("stopped before step %d: nothing more was trained", self.start_step)
        else:
            complete = self._loop(stop)
        stop.ending()  # the steps are over: a signal from here on has nothing left to stop
        self.tracker.plot(self._plot_keys())  # the last steps' curves, whatever ended the loop
        # not failed, said outright: the run may be a retry inside its caller's `except` (sys.exc_info is set there)
        self.tracker.close(failed=False)
        # A stop in the last step stopped nothing: the run is complete, the signal is reported as a late one.
        late = stop.signum if complete and stop.requested else stop.late_signum
        return self.summary(self.wall_seconds(), None if complete else stop.signum, late=late)

    def _loop(self, stop: GracefulStop) -> bool:
        """Steps `start_step`..`max_steps`, each logged and (when due) saved; returns early on a stop or when the
        collector has nothing left to do. True when every step is trained (a stop in the last step included)."""
        pipe = self.cfg.pipeline
        if self.start_step > pipe.max_steps:  # resumed at or past max_steps: the loop below has nothing to do
            log.warning(
                "resumed after step %d, pipeline.max_steps=%d: no step left to train (raise pipeline.max_steps to "
                "continue the run)",
                self.start_step - 1,
                pipe.max_steps,
            )
            return True
        if self.start_step > 1 and getattr(self.collector, "exhausted", False) is True:
            # A finite job (rollout-only) done by its checkpoint: the loop ran one more step with nothing to do,
            # logged it and saved it as a new checkpoint (pruning an older one) at every relaunch.
            log.warning("resumed after step %d: the collector's job was done; no step left", self.start_step - 1)
            return True
        # A collector with a finite job (rollout-only) knows how many steps it needs.
        total = min(pipe.max_steps, getattr(self.collector, "total_steps", None) or pipe.max_steps)
        # A bar on a terminal, else a log line per step; it starts with the step-0 (or resumed) held-out accuracy.
        bar = StepReport(
            total=total,
            initial=self.start_step - 1,
            desc=self.cfg.experiment,
            progress=pipe.progress,
            history=self.tracker.history,
        )
        last = self.start_step - 1
        try:
            for last in range(self.start_step, pipe.max_steps + 1):
                if self._one_step(last, stop, bar):
                    break
        finally:
            bar.close()
        return last == pipe.max_steps or bool(getattr(self.collector, "exhausted", False))

    def _one_step(self, step: int, stop: GracefulStop, bar: StepReport) -> bool:
        """Step `step` of the loop: train, evaluate when due, log, save when due; True when the run ends here."""
        pipe = self.cfg.pipeline
        out = self.step(step)
        self._check_finite(step, out)
        self._check_empty(step, out)
        eval_due = pipe.eval_every > 0 and (step % pipe.eval_every == 0 or step == pipe.max_steps)
        if eval_due and stop.requested:
            # A preempted job has a grace period: a long evaluation before the checkpoint could outlast it and lose
            # the step. `roll-eval` on the checkpoint gives the numbers later.
            log.warning("step %d: evaluation skipped: stopping (roll-eval evaluates the checkpoint)", step)
            self.skipped_evals.append(step)
            eval_due = False
        if eval_due:
            if self.trainer.stale:  # an off-policy collector evaluates the weights trained so far
                self.trainer.sync_weights(self.collector, out)
                if "sync" in out.timers:  # step() copied the timers before this sync: its time was left out
                    out["perf/time_sync"] = out.timers["sync"]
            out.update(self.collector.evaluate(step))
        self.tracker.log(step, out)
        bar.step(step, out)
        due = (pipe.save_every and step % pipe.save_every == 0) or step == pipe.max_steps
        saved = self.checkpoint(step) if due else None
        self.tracker.plot(self._plot_keys(), force=bool(due))
        # A collector with a finite job (rollout-only: every prompt generated) ends the run early.
        finished = getattr(self.collector, "exhausted", False) and step < pipe.max_steps
        if not (finished or stop.requested):  # a stop is checked last: a signal may arrive anywhere in the step
            return False
        if not due:
            saved = self.checkpoint(step)
        if stop.requested and (finished or step == pipe.max_steps):
            # The last step: it completed and was saved like any last step, so the run is complete, not stopped (it
            # was reported as stopped, exit 143, though a resume had nothing left to train).
            log.warning(
                "%s received in the last step (%d): the step completed and was saved (%s); the run is complete%s",
                signal_name(stop.signum),
                step,
                saved or f"no checkpoint inside a non-finite streak; last healthy: {self.healthy_checkpoint}",
                "; its final evaluation was skipped (roll-eval evaluates the checkpoint)"
                if step in self.skipped_evals
                else "",
            )
        elif stop.requested:
            # None inside a non-finite streak: say where the run really resumes from
            self.stop_checkpoint = saved or self.healthy_checkpoint
            log.warning(
                "stopped after step %d: %s; pipeline.resume=true continues from there",
                step,
                f"checkpoint {saved}" if saved else f"no checkpoint (last healthy: {self.healthy_checkpoint})",
            )
        if finished:
            log.info("step %d: the collector has nothing left to do; the run ends", step)
        return True

    def _plot_keys(self) -> tuple[str, ...]:
        return (*self.collector.plot_keys, *AGREEMENT_PLOT_KEYS)

    def step(self, step: int) -> StepLog:
        """One step: the collector's next scored batch, the update, the weight sync; returns its metrics."""
        out, t0 = StepLog(), time.perf_counter()
        collected = self.collector.next(step, out)  # None: nothing to train on this step
        # read right after `next`: a collector may say per step that its None was meant (empty_steps docstring)
        by_design = collected is None and bool(getattr(self.collector, "empty_by_design", False))
        self.empty_steps.count(step, out, trained=collected is not None, by_design=by_design)
        if collected is not None:
            self.trainer.update(step, collected, out)
            if getattr(self.collector, "on_policy", True):  # the next batch samples from the new weights
                self.trainer.sync_weights(self.collector, out)
            warning = heavy_masking_warning(out, getattr(self.cfg.algo, "off_policy_correction", None))
            if warning and not getattr(self, "_warned_masking", False):  # once per run: the metric shows every step
                self._warned_masking = True
                log.warning("step %d: %s", step, warning)
        out.update({f"perf/time_{k}": v for k, v in out.timers.items()})
        out.update(self.cluster.fault_metrics())  # workers restarted, calls timed out (this step)
        out["faults/run_restarts"] = float(self.pending_run_restarts)  # this run rebuilt after a fault
        self.pending_run_restarts = 0
        out["perf/step_seconds"] = time.perf_counter() - t0
        if collected is not None:
            out["perf/samples_per_s"] = len(collected.batch) / out["perf/step_seconds"]
        return out

    def summary(self, wall_seconds: float, signum: int | None, late: int | None = None) -> dict[str, Any]:
        """Final, best and first held-out accuracy, the last logged reward (`final_reward`) and its step
        (`final_reward_step`), wall time, folder; `stopped_by_signal`: the signal that stopped the run before its
        last step; `late_signal`: one that arrived in the last step or after it (the run is complete); `skipped`: the
        evaluations a stop skipped (the earlier processes' too: checkpointed). A complete run whose final evaluation
        was skipped, also one resumed since, has no `final_eval_accuracy` (an earlier step's would pass for the
        final model's)."""
        summary = run_summary(
            self.tracker.history,
            getattr(self, "skipped_evals", []),
            wall_seconds=wall_seconds,
            output_dir=str(self.out),
            signum=signum,
            late=late,
            collector_summary=self.collector.summary(),
        )
        return summary

    def _check_finite(self, step: int, out: StepLog) -> None:
        """Stop after pipeline.max_nonfinite_steps steps in a row whose optimizer steps were all skipped, or after
        pipeline.max_loss_scale_skips optimizer steps in a row skipped by fp16's loss scaler; the step that stops
        the run is logged first (its metrics show the blow-up; they were lost)."""
        skips, skip_limit = self.trainer.scaler_streak, self.cfg.pipeline.max_loss_scale_skips
        if skips and skip_limit and skips >= skip_limit:
            self.tracker.log(step, out)
            raise FloatingPointError(
                f"step {step}: fp16's loss scaler skipped {skips} optimizer steps in a row for an overflowing gradient "
                f"(pipeline.max_loss_scale_skips={skip_limit}): each skip halved the loss scale, so the gradient "
                "overflows fp16 at any scale; train in model.dtype=bfloat16 or float32, or lower algo.lr and check "
                "the rewards and data"
            )
        bad, limit = self.trainer.bad_steps, self.cfg.pipeline.max_nonfinite_steps
        if not (bad and limit and bad >= limit):
            return
        self.tracker.log(step, out)
        healthy = self.healthy_checkpoint
        raise FloatingPointError(
            f"step {step}: {bad} steps in a row had a non-finite loss or gradient and were skipped "
            f"(pipeline.max_nonfinite_steps={limit}); lower algo.lr, check the rewards and data"
            + (
                f"; the last checkpoint saved before them is {healthy} (pipeline.resume_from={healthy})"
                if healthy
                else "; no checkpoint was saved before them"
            )
        )

    def _check_empty(self, step: int, out: StepLog) -> None:
        """Stop after pipeline.max_empty_steps steps in a row that trained nothing: the step is logged and the
        metrics forced to disk first (no checkpoint: those steps changed no weight; the last one saved stays)."""
        if not self.empty_steps.exceeded:
            return
        self.tracker.log(step, out)
        self.tracker.plot(self._plot_keys(), force=True)
        self.tracker.sync()
        raise EmptyStepsError(self.empty_steps.error(step, out))

    # ---- checkpoints --------------------------------------------------------------------------------------
    def checkpoint(self, step: int) -> Path | None:
        """Save step `step`, unless it ends inside a non-finite streak (its weights may hold the blow-up)."""
        if self.trainer.bad_steps:
            log.warning("step %d: no checkpoint inside a streak of %d non-finite steps", step, self.trainer.bad_steps)
            return None
        self.healthy_checkpoint = self.save(step)
        return self.healthy_checkpoint

    def save(self, step: int) -> Path:
        """Write the trainer's and the collector's state as checkpoint `step`.

        A save that fails (a full disk, a quota, a second Ctrl-C) deletes its partial folder, leaves the earlier
        checkpoints as they were and ends the run: `CheckpointError` names the step, the cause and the checkpoint
        to resume from. A worker's death or timeout during the save is raised as it is (a fault: run_control may
        restart the run from that checkpoint)."""
        from roll_core.cluster.group import CallTimeoutError, WorkerDiedError

        tmp = None
        self.tracker.sync()  # the records of the steps this checkpoint covers reach the disk before it can
        try:
            tmp = self.ckpt.staging(step)
            trainer = self.trainer.save(tmp, self.cfg.model.tokenizer or self.model_path)
            state = {"trainer": trainer, "collector": self.collector.state_dict(), "experiment": self.cfg.experiment}
            state["wall_seconds"] = self.wall_seconds()
            state["skipped_evals"] = list(getattr(self, "skipped_evals", ()))  # a resumed run's summary names them
            return self.ckpt.commit(tmp, step, state)
        except BaseException as exc:
            free = free_bytes(tmp) if tmp is not None else None  # before the discard gives the space back
            if tmp is not None:
                self.ckpt.discard(tmp)
            # Interrupts and faults are raised as they are; torch's CheckpointException (an optimizer's DCP save on
            # a full disk) is a BaseException too, and was a traceback ending in "unexpected pos 704 vs 598".
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit, WorkerDiedError, CallTimeoutError)):
                raise
            raise CheckpointError(save_failure(step, exc, self.ckpt.latest(), free)) from exc

    def _restore(self, folder: Path) -> None:
        state = self.ckpt.read_state(folder)
        if "trainer" not in state:  # a checkpoint of roll before the collectors: the same state, flat
            state = {**state, "trainer": {"kl": state["kl"]}, "collector": {"sampler": state.get("sampler", {})}}
        self.trainer.restore(folder, state["trainer"])
        if state["collector"] or self.collector.state_dict():
            self.collector.load_state_dict(state["collector"])
        self.start_step = state["step"] + 1
        self.wall_before = float(state.get("wall_seconds", 0.0))  # (the earlier process's time after it: redone)
        self.skipped_evals = restored_skips(state)
        self.healthy_checkpoint = folder
        self.tracker.truncate(state["step"])
        self.empty_steps.resume(self.tracker.history)  # a streak of empty steps before the checkpoint goes on
        log.info("resumed from %s at step %d", folder, self.start_step)

    def shutdown(self) -> None:
        """Close the collector, the tracker and the cluster, then release the run folder's lock, each whatever the
        others do (best effort: after a fault, closing the collector calls dead workers; its error must neither skip
        the cluster's shutdown nor replace the run restart already decided). Errors are logged."""
        steps = (
            ("collector", getattr(getattr(self, "collector", None), "close", None)),
            # a failed run's writer too: a restarted run reopens the same event files
            ("tracker", getattr(getattr(self, "tracker", None), "close", None)),
            ("cluster", getattr(getattr(self, "cluster", None), "shutdown", None)),
            # last: the folder is another process's only once no worker of this run can write into it
            ("run-folder lock", getattr(getattr(self, "run_lock", None), "release", None)),
        )
        for what, close in steps:
            if close is None:
                continue
            try:
                close()
            except KeyboardInterrupt as exc:
                # a second signal after the run's stop: one line and 128 + N, not a traceback replacing its summary
                stop = getattr(self, "stop", None)
                signum = None if stop is None or isinstance(exc, StopAborted) else stop.signum or stop.late_signum
                if signum is None:
                    raise
                raise StopAborted(signum, self.ckpt.latest(), steps_over=True) from exc
            except Exception as exc:
                log.error("shutdown: closing the %s failed (%s: %s); going on", what, type(exc).__name__, exc)


def _in_multirun() -> bool:
    """Whether this process runs a job of a Hydra multirun."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:  # not inside a Hydra job
        return False
