"""Command-line entry points: `roll-train` (a Hydra app) and `roll-eval`.

`roll-train` is `@hydra.main` over the config groups the installed packages ship, with the user's conf folder
searched first (roll_core.config.search_path), so every Hydra override, `-m` multirun and launcher plugin works:
`roll-train experiment=quickstart`, `roll-train algo=ppo algo.lr=1e-6`. `roll-train --help` is roll's own page (usage,
each group's options without their schemas, the composed config: roll_core._train_help).
Config errors (unknown keys, wrong types, failed invariants) print one explained message and exit 2 instead
of a traceback, and so does a missing optional dependency of the chosen components (one line naming the pip
extra, checked before anything is built), and a platform this machine cannot run (hw.platform, $ROLL_PLATFORM; one
line saying why, exit 2), and flags Hydra refuses together (`-m` with `--cfg job`: one line, exit 2); any other
error propagates with its full traceback. Hydra's `Error executing job with overrides: [...]` line is not printed
above either (a single run's job error is raised after Hydra returns). Off a terminal (a log file) the libraries'
progress bars are off (roll_core.library_bars): the log holds roll's one line per step. The job's return value is
the run summary (final and best held-out accuracy), which Hydra sweepers optimise. A relative `pipeline.output_dir`
is a folder under the directory roll-train was started in, also with `hydra.job.chdir=true`.
Exit status of a signal (roll_core.pipelines.run_control): a run stopped by SIGINT/SIGTERM before its last step
exits 128 + N after its checkpoint; one whose signal came in its last step or later is complete and exits 0 (its
summary says what the signal skipped); one stopped while its pipeline was built says `stopped while building the
pipeline` in one line, after shutting down what was started, and exits 128 + N; a second signal aborting a stopping
run says so in one line naming the checkpoint to resume from (roll_core.pipelines.loop.StopAborted), exit 128 + N of
the first. A sweep a signal stopped exits
128 + N after one line saying how many of its jobs finished, failed (naming them), were stopped and were not
started, and where its summary is (roll_core.sweep_stop.SweepStopped). Once such a stop (or a signal in the last
step) has been said, a further Ctrl-C while the process exits prints one line saying so, not a KeyboardInterrupt
traceback from Python's shutdown; the next one, or SIGTERM, kills the process (roll_core.stop_signals.exiting).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from roll_core._train_help import (  # noqa: F401  (HELP_*, help_groups: re-exported, they lived here)
    HELP_FOOTER,
    HELP_HEADER,
    help_groups,
    register_help,
)
from roll_core.cli_dry_run import check_printed_config, command_line_clash
from roll_core.config.compose import ConfigError, explain, to_object
from roll_core.config.search_path import check_package_conflicts, primary_config_path
from roll_core.errors import MissingExtraError, check_installed, missing_sweep_plugin
from roll_core.library_bars import quiet_library_bars
from roll_core.registry import register_all_configs
from roll_core.stop_signals import exiting

log = logging.getLogger("roll")


def run_job(cfg: Any) -> dict[str, Any]:
    """Run one training job from a composed DictConfig (inside a Hydra job or not)."""
    typed = to_object(cfg)
    check_installed(typed)  # a missing optional package is one line now, not a traceback from a worker later
    output_dir = typed.pipeline.output_dir
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_job = HydraConfig.get()
    except ValueError:  # not inside a Hydra job
        hydra_job = None
    if hydra_job is not None and hydra_job.mode == RunMode.MULTIRUN:
        if output_dir is not None:  # one folder for every job: each would delete the last one's metrics
            log.warning(
                "pipeline.output_dir=%s is ignored in a multirun: job %s writes to its own folder %s",
                output_dir,
                hydra_job.job.num,
                hydra_job.runtime.output_dir,
            )
        output_dir = hydra_job.runtime.output_dir
    elif output_dir is None and hydra_job is not None:
        output_dir = hydra_job.runtime.output_dir
    elif hydra_job is not None:
        # A relative output_dir is the folder under the directory roll-train was started in, which Hydra's run folder
        # also is (run_dir_overrides, roll_core.run_folder): with hydra.job.chdir=true the job runs inside that folder,
        # and the pipeline (which makes it absolute from its working directory) wrote into <run>/<run> instead.
        output_dir = str(Path(hydra_job.runtime.cwd, os.path.expanduser(output_dir)))
    from roll_core.pipelines.run_control import run_with_restarts

    # A fault roll cannot repair in place restarts the run from its latest checkpoint (pipeline.max_run_restarts).
    return run_with_restarts(lambda c: pipeline_class(c.pipeline.name)(c, output_dir=output_dir), typed)


def pipeline_class(name: str) -> Any:
    """The pipeline class of every `pipeline.name`: one loop; the name picks its collector (`roll.collectors`)."""
    from roll_core.pipelines.loop import Pipeline

    return Pipeline


def _hydra_task(cfg: Any) -> Any:
    """The task Hydra runs: a single run (its summary printed; exit 128 + N when a signal stopped it) or a sweep's
    job (roll_core.sweep.run_sweep_job); returns the final held-out accuracy a sweeper optimises, or None (or, for
    an Optuna trial asked after the sweep was stopped, roll_core.sweep_stop.UnstartedTrial, which ends it)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        from roll_core.sweep import run_sweep_job

        return run_sweep_job(cfg, run_job)
    try:
        summary = run_job(cfg)
    except Exception as exc:
        # Handed to train_main, which explains it (or raises it, traceback and all): raised here, Hydra first wrote
        # `Error executing job with overrides: [...]` above roll's one-line message.
        _job_errors.append(exc)
        return None
    print(json.dumps(summary, indent=2))
    if summary.get("stopped_by_signal"):  # checkpoint written; 128 + N tells schedulers the run stopped early
        _exit_stopped(128 + int(summary["stopped_by_signal"]))
    if summary.get("late_signal"):  # a signal in the last step: the run is complete; another one only says it exits
        exiting("roll-train")
    # Sweepers (Optuna) minimise or maximise this value: the final held-out accuracy.
    return summary.get("final_eval_accuracy")


#: The error a single run's job raised, for train_main to report after Hydra returns (see _hydra_task).
_job_errors: list[Exception] = []


def run_dir_overrides(args: list[str]) -> list[str]:
    """`args` plus `hydra.run.dir=<dir>` when the command line sets `pipeline.output_dir=<dir>`, so that Hydra's run
    folder (its .hydra/ record and job log) is the run's own folder instead of a stray outputs/<date>/<time>/ in
    the working directory. Left alone: an explicit hydra.run.dir, output_dir null, and multirun (each sweep job
    has its own folder under hydra.sweep.dir).

    A leading `~/` in pipeline.output_dir is expanded to the home folder: the shell leaves `key=~/runs/a` as it is
    (it expands a tilde after `=` only in variable assignments), and the run wrote into a folder literally named
    `~` in the working directory."""
    args = [_expand_home(a) for a in args]
    if any(
        a in ("-m", "--multirun") or a.startswith(("hydra.run.dir=", "+hydra.run.dir=", "++hydra.run.dir="))
        for a in args
    ):
        return args
    value, at = _last_override(args, "pipeline.output_dir")
    if value is None or value.strip() in ("", "null", "~"):
        return args
    # Beside the override it follows: Hydra's argparse takes the overrides as one run of positionals, so one added
    # after a flag (`pipeline.output_dir=x --cfg job`) was "unrecognized arguments".
    return [*args[: at + 1], f"hydra.run.dir={value}", *args[at + 1 :]]


def _last_override(args: list[str], key: str) -> tuple[str | None, int]:
    """The value the last `key=value` override in `args` gives (any `+` prefix; in Hydra the last one wins) and its
    index; (None, -1) when there is none."""
    value, at = None, -1
    for i, a in enumerate(args):
        k, sep, v = a.partition("=")
        if sep and k.lstrip("+") == key:
            value, at = v, i
    return value, at


def _with_override(args: list[str], override: str) -> list[str]:
    """`args` with `override` placed right after the first override there (see run_dir_overrides), or last."""
    for i, a in enumerate(args):
        if "=" in a and not a.startswith("-"):
            return [*args[: i + 1], override, *args[i + 1 :]]
    return [*args, override]


def _expand_home(arg: str) -> str:
    """`pipeline.output_dir=~/x` (any `+` prefix) with the home folder in place of `~`; any other argument as is."""
    key, sep, value = arg.partition("=")
    if sep and key.lstrip("+") == "pipeline.output_dir" and value.startswith("~/"):
        return f"{key}={os.path.expanduser(value)}"
    return arg


def train_main() -> None:
    """`roll-train`: compose the primary config `rlvr` with the command-line overrides and run the pipeline."""
    import hydra

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_library_bars()  # a log file gets roll's one line per step, not transformers' bars (roll_core.library_bars)
    register_all_configs()  # each package's schemas and config folder (roll_core.config.search_path)
    try:
        check_package_conflicts()
        conf_path = primary_config_path()
    except ConfigError as exc:
        print(f"roll-train: {exc}", file=sys.stderr)
        sys.exit(2)
    # Let composition errors reach us so that we can explain them (key suggestions) instead of Hydra's dump.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    sys.argv[1:] = run_dir_overrides(sys.argv[1:])
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        sys.argv[1:] = _with_override(sys.argv[1:], f"hydra/help={register_help()}")
    clash = command_line_clash(sys.argv[1:])  # `-m --cfg job`: Hydra's ValueError was a traceback with exit 1
    if clash is not None:
        print(f"roll-train: {clash}", file=sys.stderr)
        sys.exit(2)
    main = hydra.main(version_base=None, config_path=conf_path, config_name="rlvr")(_hydra_task)
    from roll_core.run_folder import FolderRefused, release_claimed
    from roll_core.sweep_stop import SweepStopped

    # failed_jobs() counts every sweep of this process: this command's are those after the ones already there (a
    # second train_main in one process, a notebook, the test suite, exited 1 over an earlier sweep's failed job).
    earlier = sys.modules.get("roll_core.sweep")
    known = len(earlier.failed_jobs()) if earlier is not None else 0
    try:
        try:
            check_printed_config(sys.argv[1:])  # `--cfg job` prints without running: check what a run would refuse
            _job_errors.clear()
            main()  # its first callback claims the run folder before Hydra writes into it (roll_core.run_folder)
            if _job_errors:
                raise _job_errors.pop()
        except FolderRefused as exc:
            raise exc.error from None
        except (Exception, SystemExit) as exc:
            _end_unfinished_sweeps(exc)
            raise
        finally:  # the pipeline shared the folder's lock (roll_core.run_lock is re-entrant) and released its own
            release_claimed()
        from roll_core.sweep import failed_jobs

        failed = failed_jobs()[known:]
        if failed:
            print(f"roll-train: {len(failed)} sweep job(s) failed: {'; '.join(failed)}", file=sys.stderr)
            sys.exit(1)
    except SweepStopped as exc:
        # a signal stopped the sweep: say what its jobs did (which failed, too: it exits before the line above)
        print(f"roll-train: {exc.report}", file=sys.stderr)
        _exit_stopped(exc.code)
    except ConfigError as exc:
        print(f"roll-train: invalid config:\n{exc}", file=sys.stderr)
        sys.exit(2)
    except MissingExtraError as exc:
        print(f"roll-train: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        signum = _build_stop_signal(exc)
        if signum is None:
            raise
        # what the build (or the aborted run) had started is shut down and the run folder's lock released
        print(f"roll-train: {exc}", file=sys.stderr)
        _exit_stopped(128 + signum)
    except Exception as exc:
        from hydra.errors import ConfigCompositionException, OverrideParseException
        from omegaconf.errors import OmegaConfBaseException

        missing = missing_sweep_plugin(exc)  # hydra/launcher=ray or hydra/sweeper=optuna without roll-core[sweep]
        if missing is not None:
            print(f"roll-train: {missing}", file=sys.stderr)
            sys.exit(2)
        if isinstance(exc, (ConfigCompositionException, OverrideParseException, OmegaConfBaseException)):
            print(f"roll-train: invalid config:\n{explain(exc)}", file=sys.stderr)
            sys.exit(2)
        if _is_platform_unavailable(exc):
            print(f"roll-train: {_platform_message(exc)}", file=sys.stderr)
            sys.exit(2)
        if _is_reward_failure(exc) or _is_checkpoint_failure(exc) or _is_empty_steps(exc):
            # the reward failed on every row for too long, or a checkpoint could not be written (a full disk): the
            # message says what happened and which checkpoint to resume from; a traceback adds nothing
            print(f"roll-train: run stopped: {exc}", file=sys.stderr)
            sys.exit(1)
        raise


def _exit_stopped(code: int) -> None:
    """Exit with `code` (128 + N) after a stop signal: a further Ctrl-C while Python shuts down (torch's atexit
    callbacks, Ray's) says the process is exiting instead of printing a KeyboardInterrupt traceback `Exception ignored
    in atexit callback`; the next one (or SIGTERM) kills it (roll_core.stop_signals.exiting)."""
    exiting("roll-train")
    sys.exit(code)


def _end_unfinished_sweeps(exc: BaseException) -> None:
    """After `exc` ended a sweep before Hydra's on_multirun_end (the Optuna sweeper raises when every trial failed):
    write its summary and, when jobs failed, exit 1 with one message naming them and the summary instead of the
    sweeper's traceback (which says only that no trial completed). Nothing for a single run; an exception with
    no failed job propagates, after the summary is written."""
    from roll_core.sweep import end_unfinished_sweeps

    ended = end_unfinished_sweeps(exc)
    failed = [f for _, fails in ended for f in fails]
    if not failed or isinstance(exc, SystemExit):
        return
    where = ", ".join(str(path) for path, _ in ended)
    print(
        f"roll-train: the sweep stopped ({type(exc).__name__}: {exc}) after {len(failed)} job(s) failed: "
        f"{'; '.join(failed)}. Each job's outcome and error: {where}",
        file=sys.stderr,
    )
    sys.exit(1)


def _is_reward_failure(exc: BaseException) -> bool:
    """Whether `exc` is roll_core.cluster.reward_guard's RewardFailureError. Looked up among the loaded modules, not
    imported: importing the reward guard imports torch (~2 s), which a run that fails before its pipeline starts
    (a config error, `--help`) never needs; a RewardFailureError can only come from a loaded module."""
    guard = sys.modules.get("roll_core.cluster.reward_guard")
    return guard is not None and isinstance(exc, guard.RewardFailureError)


def _is_platform_unavailable(exc: BaseException) -> bool:
    """Whether `exc` is roll_hw's PlatformUnavailableError: hw.platform (or $ROLL_PLATFORM) names a platform this
    machine cannot run, found when the run resolves it (looked up among the loaded modules, as above)."""
    interface = sys.modules.get("roll_hw.interface")
    return interface is not None and isinstance(exc, interface.PlatformUnavailableError)


def _platform_message(exc: BaseException) -> str:
    """The platform error in one line, naming the key that chose the platform (its message names $ROLL_PLATFORM when
    that forced it) and what to do; the probe's reason says what to install."""
    if "ROLL_PLATFORM" in str(exc):
        return f"{exc}; set ROLL_PLATFORM to a platform this machine has, or unset it (hw=auto then detects one)"
    return f"hw.platform: {exc}; or use hw=auto, which detects the platform this machine has"


def _build_stop_signal(exc: BaseException) -> int | None:
    """The signal of run_control's StoppedWhileBuilding (a stop signal while the pipeline was built) or of loop's
    StopAborted (a second one while the run stopped), else None (looked up among the loaded modules, as above)."""
    run_control = sys.modules.get("roll_core.pipelines.run_control")
    loop = sys.modules.get("roll_core.pipelines.loop")
    if run_control is not None and isinstance(exc, run_control.StoppedWhileBuilding):
        return exc.signum
    return exc.signum if loop is not None and isinstance(exc, loop.StopAborted) else None


def _is_checkpoint_failure(exc: BaseException) -> bool:
    """Whether `exc` is roll_core.checkpoint's CheckpointError (looked up among the loaded modules, as above)."""
    checkpoint = sys.modules.get("roll_core.checkpoint")
    return checkpoint is not None and isinstance(exc, checkpoint.CheckpointError)


def _is_empty_steps(exc: BaseException) -> bool:
    """Whether `exc` is roll_core.pipelines.empty_steps' EmptyStepsError: steps in a row trained nothing (its message
    says why and what to do; looked up among the loaded modules, as above)."""
    module = sys.modules.get("roll_core.pipelines.empty_steps")
    return module is not None and isinstance(exc, module.EmptyStepsError)


def eval_main(argv: list[str] | None = None) -> int:
    """`roll-eval MODEL [MODEL ...] [overrides...]`: held-out accuracy of models, checkpoints or a run's every
    checkpoint, with pass@k and majority vote over --n responses per problem, per-domain and per-difficulty
    breakdowns, samples.jsonl, a comparison table and plot, and report.md in --out. A stop signal (Ctrl-C, SIGTERM)
    writes the models already evaluated and exits 128 + N (roll_core.eval_stop)."""
    args = eval_parser().parse_intermixed_args(argv)  # options may sit between the models and the overrides
    logging.basicConfig(level=logging.WARNING)
    quiet_library_bars()
    return run_eval(args, list(sys.argv if argv is None else ["roll-eval", *argv]))


def eval_parser() -> argparse.ArgumentParser:
    """roll-eval's argument parser (also read by the docs' command checker: which options take a value)."""
    parser = argparse.ArgumentParser(prog="roll-eval", description=eval_main.__doc__)
    parser.add_argument(
        "targets",
        nargs="+",
        metavar="MODEL_OR_OVERRIDE",
        help="models (HF folder, hub id, builtin:<name>, roll checkpoint folder, or a run folder: all its "
        "checkpoints in step order), then config overrides (key=value, e.g. env=arithmetic env.digits=2)",
    )
    parser.add_argument("--samples", type=_positive_int, default=None, help="held-out problems to evaluate (>= 1)")
    parser.add_argument(
        "--n", type=_positive_int, default=1, help="responses per problem (>= 1; > 1 needs a temperature > 0)"
    )
    parser.add_argument("--k", default=None, help="pass@k values, e.g. 1,4,8 (each <= --n; default 1,2,4.. n)")
    parser.add_argument("--data", default=None, help="a benchmark file (JSONL/Parquet): every row is held out")
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (default outputs/eval/<date>_<time>, always a new one); a folder already holding "
        "roll-eval's files (samples.jsonl, comparison.*, results.json, report.md) is refused unless --overwrite",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the files a previous evaluation (or run) left in --out"
    )
    return parser


def _episodes_se(result: dict[str, Any], key: str) -> str:
    """`± se standard error over episodes, ` for an episode result's rate `key` (empty with one episode): inside the
    printed line's parentheses, as the single-turn line's, since scripts parse the line's start."""
    se = result.get(f"{key}_stderr")
    return "" if se is None else f"± {se:.4f} standard error over episodes, "


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (--samples 0 silently meant pipeline.eval_size; -3 was a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _fresh_folder(base: Path) -> Path:
    """`base`, or `base_2`, `base_3`, ... when it exists (two calls in one second keep their own outputs)."""
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}_{i}")
    return path


def _is_override(arg: str) -> bool:
    """A Hydra override (key=value, +key=value, ~key) rather than a model ('~/models/x', a quoted home path, is a
    model)."""
    return "=" in arg or (arg.startswith("~") and not arg.startswith("~/"))


def run_eval(args: argparse.Namespace, argv: list[str]) -> int:
    """roll-eval's body (eval_main parses): models, evaluation, outputs; returns the exit status."""
    import time

    from roll_core.config.compose import compose
    from roll_core.eval_compare import existing_outputs, expand_targets, run_settings_notes, table, write_outputs
    from roll_core.eval_metrics import parse_ks
    from roll_core.eval_stop import EvalStop, EvalStopped, stop_line, stop_note
    from roll_core.evaluate import check_sampling, eval_temperature, evaluate_model
    from roll_core.report import write_eval_report

    models = [a for a in args.targets if not _is_override(a)]
    overrides = [a for a in args.targets if _is_override(a)]
    # `--data=~/x` and `--out=~/x` reach us unexpanded (the shell expands a tilde that starts a word only).
    data = str(Path(args.data).expanduser()) if args.data else None
    if data and not Path(data).exists():  # the task's message would name env.path
        print(f"roll-eval: --data {args.data} does not exist", file=sys.stderr)
        return 2
    if data:  # a benchmark file: the file task, every row held out (training rows are not used)
        given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
        # After the user's overrides (the last value of a key wins); sizes only where the user set none.
        overrides = [*overrides, "env=file", f"env.path={data}", f"env.eval_path={data}"]
        overrides += [] if "env.eval_size" in given else ["env.eval_size=100000000"]
        overrides += [] if args.samples or "pipeline.eval_size" in given else ["pipeline.eval_size=100000000"]
    try:
        ks = parse_ks(args.k, args.n)
    except ValueError as exc:  # --k out of [1, --n]
        print(f"roll-eval: {exc}", file=sys.stderr)
        return 2
    out_arg = Path(args.out).expanduser() if args.out else None
    if out_arg is not None and out_arg.exists() and not out_arg.is_dir():  # said before hours of evaluation
        print(f"roll-eval: --out {out_arg} is a file, not a folder", file=sys.stderr)
        return 2
    if out_arg is not None and existing_outputs(out_arg) and not args.overwrite:  # a previous evaluation's results
        names = ", ".join(p.name for p in existing_outputs(out_arg))
        print(
            f"roll-eval: --out {out_arg} already holds the results of an earlier evaluation or run ({names}): give "
            "another --out, or add --overwrite to replace them",
            file=sys.stderr,
        )
        return 2
    try:
        targets = expand_targets(models)
        configs = []
        for t in targets:  # every config checked before the first engine starts
            cfg = to_object(compose([*overrides, f"model.path={t.model}"]))
            check_installed(cfg, training=False)
            check_sampling(cfg, args.n)
            configs.append(cfg)
        # A checkpoint evaluated under other settings than its run's: said before hours of evaluation, and in report.md.
        notes = run_settings_notes(targets, configs, overrides, data=bool(args.data), samples=bool(args.samples))
        for note in notes:
            print(f"roll-eval: warning: {note}", file=sys.stderr, flush=True)
        results, stopped = [], None
        try:
            with EvalStop():  # a stop signal keeps the models already evaluated (roll_core.eval_stop)
                for t, cfg in zip(targets, configs):
                    if len(targets) > 1:
                        print(f"evaluating {t.label} ({t.model}) ...", file=sys.stderr, flush=True)
                    # Settings only checked against the world (a model folder, a held-out split) fail here alike.
                    results.append((t, evaluate_model(cfg, samples=args.samples, n=args.n, ks=ks)))
        except EvalStopped as exc:
            stopped = exc.signum
            print(stop_line(stopped, targets[len(results)].label, len(results), len(targets)), file=sys.stderr)
            if not results:
                return 128 + stopped
            notes = [*notes, stop_note(stopped, [f"{t.label} ({t.model})" for t in targets[len(results) :]])]
    except ConfigError as exc:
        print(f"roll-eval: invalid config:\n{exc}", file=sys.stderr)
        return 2
    except MissingExtraError as exc:
        print(f"roll-eval: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not _is_platform_unavailable(exc):
            raise
        print(f"roll-eval: {_platform_message(exc)}", file=sys.stderr)
        return 2
    out = (
        out_arg if out_arg is not None else _fresh_folder(Path("outputs") / "eval" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    )
    if out_arg is not None and existing_outputs(out) and not args.overwrite:  # another call wrote there meanwhile
        out = _fresh_folder(out)
        print(f"roll-eval: --out {out_arg} was written to during the evaluation: writing to {out}", file=sys.stderr)
    for stale in existing_outputs(out):  # --overwrite: no earlier file (a plot, results.json) mixes with these
        stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    first_cfg = configs[0]
    settings = {
        "experiment": first_cfg.experiment,
        "task": results[0][1]["task"],
        "temperature": eval_temperature(first_cfg),
        "seed": first_cfg.pipeline.seed,
        "ks": ks,
        "n": args.n,
    }
    if any("rows" not in r for _, r in results):  # episodes (agentic, agent programs): aggregate metrics only
        (out / "results.json").write_text(json.dumps([{"label": t.label, **r} for t, r in results], indent=2))
        write_eval_report(out, results, settings=settings, files={"json": out / "results.json"}, argv=argv, notes=notes)
        for t, result in results:
            if not result.get("agentic"):
                print(
                    f"accuracy {result['accuracy']:.4f} on {result['n']} held-out problems of {result['task']} "
                    f"({_episodes_se(result, 'accuracy')}mean reward {result['reward']:.4f}, model {t.model})"
                )
                continue
            ends = ", ".join(f"{k} {v:.0%}" for k, v in sorted(result["ends"].items()))
            print(
                f"success rate {result['success_rate']:.4f} on {result['n']} held-out seeds of {result['task']} "
                f"({_episodes_se(result, 'success_rate')}mean reward {result['reward']:.4f}, "
                f"mean turns {result['mean_turns']:.2f}, invalid actions {result['invalid_action_rate']:.1%} of "
                f"turns, ended by: {ends}; model {t.model})"
            )
        return 0 if stopped is None else 128 + stopped
    files = write_outputs(out, results, ks, args.n, settings)
    files["report"] = write_eval_report(out, results, settings=settings, files=files, argv=argv, notes=notes)
    if len(results) == 1:  # the one-model line scripts (and the README tests) parse comes first
        t, result = results[0]
        m = result["metrics"]
        se = m.get("accuracy_stderr")  # inside the parentheses: the line's start is what scripts parse
        pm = "" if se is None else f"± {se:.4f} standard error over problems, "
        print(
            f"accuracy {result['accuracy']:.4f} on {result['n']} held-out problems of {result['task']} "
            f"({pm}mean reward {result['reward']:.4f}, model {t.model})"
        )

        def shown(key: str, name: str) -> str:  # "name mean ± standard error" (no error with one problem)
            se = m.get(f"{key}_stderr")
            return f"{name} {m[key]:.4f}" + ("" if se is None else f" ± {se:.4f}")

        extra = [shown(f"pass@{k}", f"pass@{k}") for k in ks if m.get(f"pass@{k}") is not None and args.n > 1]
        if m.get("maj") is not None:
            extra.append(shown("maj", f"maj@{args.n}"))
        extra += [f"mean length {m['length_mean']:.1f}", f"truncated {m['truncation_rate']:.1%}"]
        print(", ".join(extra))
    else:
        print(table(results, ks, args.n))
    print(f"wrote {out}/ (report.md, comparison.md, comparison.csv, samples.jsonl)")
    failures = _reward_failures(results)
    return failures if stopped is None else 128 + stopped


def _reward_failures(results: list[Any]) -> int:
    """1 (with one line each) when the reward failed on every row of a model's evaluation: its accuracy is the
    failure score, not a measurement (a training run stops on that; roll-eval printed 0.0000 and exited 0)."""
    from roll_core.cluster.reward_guard import all_rows_failed

    failed = [(t, r["reward_counters"]) for t, r in results if all_rows_failed(r.get("reward_counters") or {})]

    def causes(c: dict[str, Any]) -> str:
        return ", ".join(
            f"{k.removeprefix('failed_')} {v}"
            for k, v in c.items()
            if k.startswith("failed_") and k != "failed_rows" and v
        )

    for t, c in failed:
        print(
            f"roll-eval: the reward failed on every row of {t.label} ({c.get('rows', 0)} rows; {causes(c)}): its "
            "accuracy says nothing; fix the reward (see the warnings above) and evaluate again",
            file=sys.stderr,
        )
    for t, r in results:  # some rows only: the accuracy stands, lowered by rows that were never graded
        c = r.get("reward_counters") or {}
        if c.get("failed_rows", 0) and not all_rows_failed(c):
            print(
                f"roll-eval: the reward could not score {c['failed_rows']} of {c.get('rows', 0)} rows of {t.label} "
                f"({causes(c)}): they count as wrong in its accuracy; see the warnings above",
                file=sys.stderr,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    train_main()
