"""Command-line entry points: `roll-train` (a Hydra app) and `roll-eval`.

`roll-train` is `@hydra.main` over the config groups the installed packages ship, with the user's conf folder
searched first (roll_core.config.search_path), so every Hydra override, `-m` multirun and launcher plugin works:
`roll-train experiment=quickstart`, `roll-train algo=ppo algo.lr=1e-6`.
Config errors (unknown keys, wrong types, failed invariants) print one explained message and exit 2 instead
of a traceback, and so does a missing optional dependency of the chosen components (one line naming the pip
extra, checked before anything is built); any other error propagates with its full traceback. The job's return
value is the run summary (final and best held-out accuracy), which Hydra sweepers optimise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from roll_core.cluster.reward_guard import RewardFailureError
from roll_core.config.compose import ConfigError, explain, to_object
from roll_core.config.search_path import primary_config_path
from roll_core.errors import MissingExtraError, check_installed
from roll_core.registry import register_all_configs

log = logging.getLogger("roll")


def run_job(cfg: Any) -> dict[str, Any]:
    """Run one training job from a composed DictConfig (inside a Hydra job or not)."""
    typed = to_object(cfg)
    check_installed(typed)  # a missing optional package is one line now, not a traceback from a worker later
    output_dir = typed.pipeline.output_dir
    if output_dir is None:
        try:
            from hydra.core.hydra_config import HydraConfig

            output_dir = HydraConfig.get().runtime.output_dir
        except ValueError:  # not inside a Hydra job
            output_dir = None
    from roll_core.pipelines.run_control import run_with_restarts

    # A fault roll cannot repair in place restarts the run from its latest checkpoint (pipeline.max_run_restarts).
    return run_with_restarts(lambda c: pipeline_class(c.pipeline.name)(c, output_dir=output_dir), typed)


def pipeline_class(name: str) -> Any:
    """The pipeline class of every `pipeline.name`: one loop; the name picks its collector (`roll.collectors`)."""
    from roll_core.pipelines.loop import Pipeline

    return Pipeline


def _hydra_task(cfg: Any) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        from roll_core.sweep import run_sweep_job

        return run_sweep_job(cfg, run_job)
    summary = run_job(cfg)
    print(json.dumps(summary, indent=2))
    if summary.get("stopped_by_signal"):  # checkpoint written; 128 + N tells schedulers the run stopped early
        sys.exit(128 + int(summary["stopped_by_signal"]))
    # Sweepers (Optuna) minimise or maximise this value: the final held-out accuracy.
    return summary.get("final_eval_accuracy")


def run_dir_overrides(args: list[str]) -> list[str]:
    """`args` plus `hydra.run.dir=<dir>` when the command line sets `pipeline.output_dir=<dir>`, so that Hydra's run
    folder (its .hydra/ record and job log) is the run's own folder instead of a stray outputs/<date>/<time>/ in
    the working directory. Left alone: an explicit hydra.run.dir, output_dir null, and multirun (each sweep job
    has its own folder under hydra.sweep.dir)."""
    if any(
        a in ("-m", "--multirun") or a.startswith(("hydra.run.dir=", "+hydra.run.dir=", "++hydra.run.dir="))
        for a in args
    ):
        return list(args)
    value = None
    for a in args:
        key, sep, v = a.partition("=")
        if sep and key.lstrip("+") == "pipeline.output_dir":
            value = v
    if value is None or value.strip() in ("", "null", "~"):
        return list(args)
    return [*args, f"hydra.run.dir={value}"]


def train_main() -> None:
    """`roll-train`: compose the primary config `rlvr` with the command-line overrides and run the pipeline."""
    import hydra

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    register_all_configs()  # each package's schemas and config folder (roll_core.config.search_path)
    try:
        conf_path = primary_config_path()
    except ConfigError as exc:
        print(f"roll-train: {exc}", file=sys.stderr)
        sys.exit(2)
    # Let composition errors reach us so that we can explain them (key suggestions) instead of Hydra's dump.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    sys.argv[1:] = run_dir_overrides(sys.argv[1:])
    main = hydra.main(version_base=None, config_path=conf_path, config_name="rlvr")(_hydra_task)
    try:
        main()
        from roll_core.sweep import failed_jobs

        if failed_jobs():
            print(f"roll-train: {len(failed_jobs())} sweep job(s) failed: {'; '.join(failed_jobs())}", file=sys.stderr)
            sys.exit(1)
    except ConfigError as exc:
        print(f"roll-train: invalid config:\n{exc}", file=sys.stderr)
        sys.exit(2)
    except MissingExtraError as exc:
        print(f"roll-train: {exc}", file=sys.stderr)
        sys.exit(2)
    except RewardFailureError as exc:  # the run's reward failed on every row for too long: one message, no trace
        print(f"roll-train: run stopped: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        from hydra.errors import ConfigCompositionException, OverrideParseException
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(exc, (ConfigCompositionException, OverrideParseException, OmegaConfBaseException)):
            print(f"roll-train: invalid config:\n{explain(exc)}", file=sys.stderr)
            sys.exit(2)
        raise


def eval_main(argv: list[str] | None = None) -> int:
    """`roll-eval MODEL [overrides...]`: held-out accuracy of a model folder, hub id or checkpoint."""
    parser = argparse.ArgumentParser(prog="roll-eval", description=eval_main.__doc__)
    parser.add_argument("model", help="HF folder, hub id, builtin:<name>, or a roll checkpoint folder")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. env=arithmetic env.digits=2")
    parser.add_argument("--samples", type=int, default=None, help="held-out problems to evaluate")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from pathlib import Path

    from roll_core.config.compose import compose
    from roll_core.evaluate import evaluate_model

    model = args.model
    if (Path(model) / "actor" / "model" / "config.json").is_file():  # a roll checkpoint folder
        model = str(Path(model) / "actor" / "model")
    try:
        cfg = to_object(compose([*args.overrides, f"model.path={model}"]))
        check_installed(cfg, training=False)
        # Settings only checked against the world (a model folder, a held-out split) fail here the same way.
        result = evaluate_model(cfg, samples=args.samples)
    except ConfigError as exc:
        print(f"roll-eval: invalid config:\n{exc}", file=sys.stderr)
        return 2
    except MissingExtraError as exc:
        print(f"roll-eval: {exc}", file=sys.stderr)
        return 2
    if result.get("agentic"):
        ends = ", ".join(f"{k} {v:.0%}" for k, v in sorted(result["ends"].items()))
        print(
            f"success rate {result['success_rate']:.4f} on {result['n']} held-out seeds of {result['task']} "
            f"(mean reward {result['reward']:.4f}, mean turns {result['mean_turns']:.2f}, invalid actions "
            f"{result['invalid_action_rate']:.1%} of turns, ended by: {ends}; model {model})"
        )
        return 0
    print(
        f"accuracy {result['accuracy']:.4f} on {result['n']} held-out problems of {result['task']} "
        f"(mean reward {result['reward']:.4f}, model {model})"
    )
    return 0


if __name__ == "__main__":
    train_main()
