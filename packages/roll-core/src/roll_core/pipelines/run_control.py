"""Run control: which folder a resumed run continues, restarting a run after a fault, stopping on SIGINT/SIGTERM.

Resume contract: `pipeline.resume_from=<folder>` continues that run (a run folder holding `checkpoints/`: from its
latest checkpoint; or one checkpoint folder `.../checkpoints/step_N`: from that one, the run's newer checkpoints
moved aside into `checkpoints/abandoned-<time>/`, never deleted, so the rolled-back run's own saves and restarts
do not mix with them). `pipeline.resume=true` continues the run in `output_dir` if it has a checkpoint; otherwise,
when the folder is Hydra's generated one (no `pipeline.output_dir`, not a multirun: every launch gets a fresh
folder), the most recent run of the same experiment next to it (`outputs/*/*` for Hydra's default layout, or
siblings of the folder); the log says which folder and step. Nothing found: a warning says so and the run starts
at step 1. A run that does not resume refuses a folder that already holds checkpoints (its own saves would be
pruned against the old run's, and a restart would load the old run's weights).

Restart contract (`run_with_restarts`): when a run fails with a fault roll cannot repair in place (a trainer rank
died or hung: its ranks share torch.distributed groups, so one cannot be re-created alone; or a restartable role
used up cluster.max_restarts), every role is shut down and the run is rebuilt from its latest checkpoint, as
`pipeline.resume_from` would, up to `pipeline.max_run_restarts` times. The steps after that checkpoint are redone
(their logged metrics are truncated on resume), the first step after a restart reports `faults/run_restarts`, and
the summary counts them. The run folder's lock (roll_core.run_lock) is held across the restarts: no other process
takes the folder in between. An error with every worker alive is a bug, not a fault: it ends the run (a restart would
only repeat it), as does a fault before the first checkpoint (nothing to restart from: the message says so).

Stop contract: inside `GracefulStop`, the first SIGINT/SIGTERM sets `requested` (the loop finishes the step, saves
a checkpoint and returns); a second one raises KeyboardInterrupt at once. A stop requested in the run's last step
(`pipeline.max_steps`, or the step that finishes a finite job) stops nothing: the step completes and is saved as
usual, its due evaluation is skipped (the checkpoint first, within a preemption's grace period) and the run is
complete: summary `stopped_by_signal` None, `late_signal` N, `skipped` naming the evaluation, exit 0, report.md
`finished ...` saying so, and a resume trains nothing (roll_core.pipelines.loop). It was reported as a stop
(exit 143, `stopped by signal 15`) although every step was trained and saved. Once the steps are over (`ending()`: the
last curves, the trackers' close, report.md, the shutdown of a run that returned its summary) a first signal only
says so: the run has nothing left to stop, it ends as it would have (its status and exit code unchanged). Before,
the handlers were already restored there: a scheduler's SIGTERM in that last stretch (a W&B upload at close takes
minutes) killed the process (exit 143, no report.md) after a run that had finished. Handlers are restored on exit,
and nothing is installed off the main thread (signals are delivered there only).

Build contract: while a pipeline is built (`BuildStop`: the run folder's lock, Ray's start, model loading, engine
start; a build has no step to finish and can take minutes) the first SIGINT/SIGTERM raises `StoppedWhileBuilding`
at once: the pipeline shuts down what it had started (workers, Ray, the lock: `Pipeline.shutdown`) and `roll-train`
says `stopped while building the pipeline` in one line, exit 128 + N. A second signal aborts the cleanup
(KeyboardInterrupt). Before, a SIGINT there was a KeyboardInterrupt traceback (exit 1) and a SIGTERM killed the
process outright (with Ray started, Ray's own handler aborted it: exit 134 and a stack dump).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from roll_core.errors import ConfigError
from roll_core.stop_signals import StopSignals

log = logging.getLogger(__name__)


def _latest_checkpoint(run: Path) -> Path | None:
    from roll_core.checkpoint import CheckpointManager

    return CheckpointManager(run).latest()


def _experiment_of(ckpt: Path) -> str | None:
    try:
        return json.loads((ckpt / "state.json").read_text()).get("experiment")
    except (OSError, ValueError):
        return None


def find_previous_run(out: Path, experiment: str) -> Path | None:
    """The most recently checkpointed run of `experiment` near `out` (siblings and `../../*/*`), or None."""
    candidates = {p for p in out.parent.glob("*") if p.is_dir()}
    candidates |= {p for p in out.parent.parent.glob("*/*") if p.is_dir()}
    candidates.discard(out)
    best: tuple[float, Path] | None = None
    for run in candidates:
        ckpt = _latest_checkpoint(run)
        if ckpt is None or _experiment_of(ckpt) != experiment:
            continue
        mtime = (ckpt / "state.json").stat().st_mtime
        if best is None or mtime > best[0]:
            best = (mtime, run)
    return best[1] if best else None


def named_checkpoint(resume_from: str | None) -> Path | None:
    """The checkpoint folder `pipeline.resume_from` names (`.../checkpoints/step_N`), or None (a run folder); a
    ConfigError for a `step_*` folder that is no complete checkpoint (roll_core.checkpoint.named_checkpoint_folder)."""
    from roll_core.checkpoint import named_checkpoint_folder

    return named_checkpoint_folder(resume_from) if resume_from else None


def set_aside_newer(checkpoint: Path) -> list[Path]:
    """Move the checkpoints of `checkpoint`'s run that are newer than it into `checkpoints/abandoned-<time>/`
    (a rollback: they are kept, out of `latest()`'s and pruning's sight); returns where they went."""
    from roll_core.checkpoint import step_of

    root, named = checkpoint.parent, _checkpoint_step(checkpoint)
    # Compared as numbers: by name, `step_1000000` sorted before `step_999999` and stayed in `latest()`'s sight.
    newer = [
        p
        for p in sorted(root.glob("step_*"), key=lambda p: (step_of(p) or 0, p.name))
        if p.is_dir() and not p.name.endswith(".tmp") and (step_of(p) or 0) > named
    ]
    if not newer:
        return []
    import tempfile

    aside = Path(tempfile.mkdtemp(prefix=f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}-", dir=root))  # unique
    moved = []
    for p in newer:
        p.rename(aside / p.name)
        moved.append(aside / p.name)
    log.warning(
        "pipeline.resume_from=%s: rolling back; the run's %d newer checkpoint(s) (%s) moved to %s",
        checkpoint,
        len(moved),
        ", ".join(p.name for p in newer),
        aside,
    )
    return moved


def _checkpoint_step(checkpoint: Path) -> int:
    """The step checkpoint `checkpoint` was saved at: its name's (`step_N`), else its state.json's (a user's copy
    such as `checkpoints/best`, whose name holds none: read as step 0, every `step_N` of the run, the older ones
    and the one it copies too, was set aside as newer than it)."""
    from roll_core.checkpoint import step_of

    named = step_of(checkpoint)
    if named is not None:
        return named
    try:
        return int(json.loads((checkpoint / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"pipeline.resume_from={checkpoint}: its state.json records no step ({type(exc).__name__}: {exc}), so the "
            "run's checkpoints newer than it cannot be told: name a checkpoints/step_N folder"
        ) from exc


def resolve_run_folder(out: Path, resume: bool, resume_from: str | None, experiment: str, search: bool = True) -> Path:
    """The folder this run writes to: `out`, or the run it resumes (see the module docstring). `search`: whether
    `resume=true` may continue another run near `out` (only for Hydra's generated folders)."""
    if resume_from:
        named = named_checkpoint(resume_from)
        folder = named.parent.parent if named is not None else Path(resume_from).expanduser()
        # A named checkpoint is complete (named_checkpoint checked it): a user's copy (`checkpoints/best`) in a run
        # folder holding no `step_N` was refused as "no complete checkpoint" though it is the one to resume from.
        if named is None and _latest_checkpoint(folder) is None:
            from roll_core.checkpoint import not_a_run_hint

            raise ConfigError(
                f"pipeline.resume_from={resume_from}: no complete checkpoint under {folder}/checkpoints "
                f"({not_a_run_hint(folder)})"
            )
        # A named checkpoint's newer ones are moved aside by the loop once its config was accepted (`set_aside_newer`):
        # a refused resume leaves the run as it was.
        return folder
    if not resume:
        if _latest_checkpoint(out) is not None:
            # a ConfigError: roll-train says it in one line (exit 2), not with a traceback
            raise ConfigError(
                f"{out} already holds the checkpoints of a run (latest {_latest_checkpoint(out).name}): continue it "
                "with pipeline.resume=true, or give this run another pipeline.output_dir (or delete "
                f"{out / 'checkpoints'})"
            )
        return out
    if _latest_checkpoint(out) is not None:
        return out
    if not search:
        log.warning(
            "pipeline.resume=true: no checkpoint in %s (an explicit pipeline.output_dir or a multirun job continues "
            "only its own folder): starting from step 1",
            out,
        )
        return out
    found = find_previous_run(out, experiment)
    if found is None:
        log.warning(
            "pipeline.resume=true: no checkpoint of experiment %r in %s or next to it: starting from step 1",
            experiment,
            out,
        )
        return out
    log.info("pipeline.resume=true: continuing the latest run of %r: %s", experiment, found)
    return found


def fault_of(pipeline: Any, exc: BaseException) -> str | None:
    """Why `exc` is a fault a restart can repair (a worker died or hung), or None for any other error."""
    from roll_core.cluster.group import CallTimeoutError, WorkerDiedError

    if isinstance(exc, (WorkerDiedError, CallTimeoutError)):
        return str(exc)
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: the user's decision
        return None
    # A peer's death often surfaces as another rank's error (a collective whose peer vanished): look for the dead.
    dead = pipeline.cluster.dead_workers()
    return f"{', '.join(dead)} died ({type(exc).__name__}: {exc})" if dead else None


def run_with_restarts(make: Callable[[Any], Any], cfg: Any) -> dict[str, Any]:
    """Build the pipeline with `make(cfg)` and run it, restarting from the latest checkpoint after a fault (see the
    module docstring); returns the run summary with `run_restarts`."""
    restarts, t0 = 0, time.perf_counter()
    kept = None  # a share of the run folder's lock, held across restarts: no other process takes it in between
    try:
        while True:
            pipeline = make(cfg)
            if kept is None and getattr(pipeline, "run_lock", None) is not None:
                kept = pipeline.run_lock.share()
            summary = _run_once(pipeline, cfg, restarts)
            if isinstance(summary, Path):  # a fault: the run restarts from this checkpoint
                restarts += 1
                again = dataclasses.replace(cfg.pipeline, resume=False, resume_from=str(summary))
                cfg = dataclasses.replace(cfg, pipeline=again)
                continue
            summary["run_restarts"] = restarts
            # this process's incarnations, or the run's own total when it resumed an earlier process's checkpoint
            summary["wall_seconds"] = max(summary["wall_seconds"], time.perf_counter() - t0)
            return summary
    finally:
        if kept is not None:
            kept.release()


def _run_once(pipeline: Any, cfg: Any, restarts: int) -> dict[str, Any] | Path:
    """Run `pipeline` and shut it down whatever happens; returns its summary, or after a fault a restart repairs, the
    checkpoint to restart from (any other error is raised)."""
    pipeline.pending_run_restarts = 1 if restarts else 0
    finished = False
    try:
        summary = pipeline.run()
        finished = True
        return summary
    except BaseException as exc:
        reason = fault_of(pipeline, exc)
        if reason is None:
            raise
        stop = getattr(pipeline, "stop", None)
        if stop is not None and stop.requested:  # a preemption's signal and its workers' deaths come together
            log.error("run not restarted after the fault: signal %s asked it to stop", stop.signum)
            raise
        latest = pipeline.ckpt.latest()
        limit = cfg.pipeline.max_run_restarts
        if latest is None or restarts >= limit:
            why = (
                "no checkpoint was saved yet (pipeline.save_every=N saves every N steps)"
                if latest is None
                else f"{restarts} run restart(s) already (pipeline.max_run_restarts={limit})"
            )
            log.error("run not restarted after the fault: %s", why)
            raise
        log.warning(
            "run restart %d/%d after a fault (%s): resuming from %s, the steps after it are redone",
            restarts + 1,
            limit,
            reason,
            latest,
        )
        return Path(latest)
    finally:
        if finished:  # nothing left to stop: a signal now must not kill the process (see the module docstring)
            with GracefulStop() as stop:
                stop.ending(getattr(pipeline, "stop", None))
                pipeline.shutdown()
        else:  # a failure or a restart: a signal keeps its default meaning
            pipeline.shutdown()


class GracefulStop(StopSignals):
    """Context manager turning the first SIGINT/SIGTERM into `requested = True` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.requested = False
        self.signum: int | None = None
        #: Set by `ending()`: the steps are over; a first signal is only logged (and recorded as `late_signum`).
        self.ended = False
        self.late_signum: int | None = None

    def ending(self, earlier: Any = None) -> None:
        """The steps are over: from here a first signal does not request a stop (there is none left to make), it is
        logged and the run ends as it would have; a second one still raises KeyboardInterrupt. `earlier`: the run's
        own stop handling, whose signal counts as the first (the next one aborts)."""
        self.ended = True
        if earlier is not None and self.late_signum is None:
            late = getattr(earlier, "late_signum", None)
            self.late_signum = late or (
                getattr(earlier, "signum", None) if getattr(earlier, "requested", False) else None
            )

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested or self.late_signum is not None:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        if self.ended:
            self.late_signum = signum
            log.warning(
                "%s received after the last step: finishing the run's wrap-up (send it again to abort now)", name
            )
            return
        self.requested, self.signum = True, signum
        log.warning(
            "%s received: finishing this step, saving a checkpoint and stopping (send it again to abort now)", name
        )


class StoppedWhileBuilding(KeyboardInterrupt):
    """The first SIGINT/SIGTERM while a pipeline was built (see the module docstring). A KeyboardInterrupt: no
    `except Exception` in the build swallows it, and run_with_restarts does not take it for a fault."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(
            f"stopped while building the pipeline ({signal.Signals(signum).name}): nothing was trained and no "
            "checkpoint was written; what the build had started was shut down"
        )


class BuildStop(StopSignals):
    """Context manager for a pipeline's build: the first SIGINT/SIGTERM raises `StoppedWhileBuilding`, a second
    KeyboardInterrupt (see the module docstring). `rearm()` installs the handlers again after code that replaced them
    (`ray.init` installs Ray's own SIGTERM handler, which aborts the process with a stack dump). The stop reaches the
    caller as StoppedWhileBuilding also where a library replaced it: a bare KeyboardInterrupt out of a Ray wait is
    turned back into it on exit, and one a library swallowed is raised at the next `rearm()` or `check()`, which the
    pipeline calls at the end of its build (one lost in a `__del__` is raised again at once: roll_core.stop_signals).
    A first signal inside `ray.init` is raised at the `rearm()` after it: raised there, it could land inside Ray's
    CoreWorker constructor, whose half-made core worker `ray.shutdown()` cannot see; it was destroyed at the process's
    exit while its threads ran (a segmentation fault, exit -11, after the stop line)."""

    def __init__(self) -> None:
        super().__init__()
        self.signum: int | None = None
        self._aborted = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the cleanup of the first one is running: abort it
            self._aborted = True
            raise KeyboardInterrupt
        self.signum = signum
        if self._defers(frame):  # raised by the rearm() after ray.init (see the class docstring)
            log.warning(
                "%s received while Ray starts: stopping once it has started, then shutting down what was started "
                "(send it again to abort now)",
                signal.Signals(signum).name,
            )
            return
        log.warning(
            "%s received while building the pipeline: stopping, shutting down what was started (send it again to "
            "abort now)",
            signal.Signals(signum).name,
        )
        raise StoppedWhileBuilding(signum)

    def check(self) -> None:
        """Raise StoppedWhileBuilding for a stop signal whose exception a library swallowed (an `except
        BaseException` around a callback): the build stops here, late but not lost. The pipeline calls it once its
        build is done, before the steps start: a stop swallowed after the last `rearm()` trained every step."""
        # Taken, so the resend thread does not deliver it once more: raised again into the build's shutdown (the
        # `except BaseException` that gives back Ray, placement groups and the run lock), it cut that shutdown short.
        self.take_lost()
        if self.signum is not None:
            # A swallowed abort (the second signal) is an abort still: the build must not finish and train.
            raise KeyboardInterrupt if self._aborted else StoppedWhileBuilding(self.signum)

    def _defers(self, frame: FrameType | None) -> bool:
        """Inside ray.init's connection: a stop is raised by the rearm() after it (a dropped one re-delivered too)."""
        return _in_ray_init(frame)

    def rearm(self) -> None:
        """`check()`, then install the handlers again, also when it raises: the stop's cleanup (the build's shutdown)
        runs with them, and a second signal aborts it (Ray's SIGTERM handler, installed by ray.init, took it)."""
        try:
            self.check()
        finally:
            super().rearm()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        error = exc[1]
        if (
            self.signum is not None
            and not self._aborted
            and error is not None
            and not isinstance(error, StoppedWhileBuilding)
        ):
            # Ray waits (ray.get, ray.wait: a worker's start) run the handler themselves and raise a bare
            # KeyboardInterrupt in place of its StoppedWhileBuilding: roll-train printed a traceback, exit 1. Any
            # other error after a stop (a deferred one inside ray.init, then Ray's connection error) is the stop too,
            # the error kept as its cause: the user asked to stop (exit 130/143), not a failed run (exit 1).
            cause = None if isinstance(error, KeyboardInterrupt) else error
            raise StoppedWhileBuilding(self.signum) from cause


def _in_ray_init(frame: FrameType | None) -> bool:
    """Whether `frame` runs inside `ray.init`'s driver connection (`connect`: the CoreWorker constructor, where a
    raised stop left a half-made core worker). Not the rest of `init`: its wait for a cluster that does not answer
    retries for minutes, and a stop deferred there waited as long."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "ray._private.worker" and frame.f_code.co_name == "connect":
            return True
        frame = frame.f_back
    return False
