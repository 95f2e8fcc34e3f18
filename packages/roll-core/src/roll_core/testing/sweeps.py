"""Sweeps (roll_core.sweep) for tests, with no training and no Hydra process: the job wrapper `run_sweep_job` run
as Hydra runs it in one job of a multirun (`run_job`, HydraConfig faked), the config Hydra hands
`SweepSummaryCallback` (`multirun_config`), the summary.csv a sweep leaves (`summary_rows`), a clean slate of
the per-process sweep state for each test (`reset_sweep_state`), the root logger put back after a test that ran
roll-train in-process (`root_logging_restored`), and roll-train's arguments for a small Optuna sweep
(`optuna_sweep_args`). Neither pytest nor Ray is imported.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from omegaconf import OmegaConf

import roll_core.sweep as sweep
import roll_core.sweep_optuna as sweep_optuna

__all__ = [
    "multirun_config",
    "optuna_sweep_args",
    "reset_sweep_state",
    "root_logging_restored",
    "run_job",
    "summary_rows",
]


@contextmanager
def root_logging_restored() -> Iterator[None]:
    """The root logger's handlers and level as they were before the block: Hydra's job logging adds root handlers
    on a test's captured streams, and later tests' logs would hit them."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)


def reset_sweep_state(monkeypatch: Any) -> None:
    """Give this test no started sweep, failed job or stop signal of earlier ones (roll_core.sweep keeps them per
    process, for `failed_jobs()` and the callback); `monkeypatch`: pytest's, which puts them back after the test."""
    monkeypatch.setattr(sweep, "_failed_jobs", [])
    monkeypatch.setattr(sweep, "_sweeps", {}, raising=False)
    monkeypatch.setattr(sweep, "_stopped", {}, raising=False)
    monkeypatch.setattr(sweep, "_unfinished", set(), raising=False)
    monkeypatch.setattr(sweep, "_unstarted", {}, raising=False)
    sweep_optuna.unwatch()  # an Optuna sweep's wrappers an earlier test left (its sweep() never ran)
    monkeypatch.setattr(sweep_optuna, "_studies", {})


def optuna_sweep_args(sweep_dir: Path, n_trials: int, n_jobs: int = 1, *more: str) -> list[str]:
    """roll-train's arguments for an Optuna sweep (hydra-optuna-sweeper) into `sweep_dir`: `n_trials` trials,
    `n_jobs` at a time, maximising the job's value, the sampler seeded (0), over `algo.lr` in [1e-6, 1e-5];
    `more`: further overrides (a storage and study name, pipeline.resume=true)."""
    return [
        "-m",
        "hydra/sweeper=optuna",
        f"hydra.sweeper.n_trials={n_trials}",
        f"hydra.sweeper.n_jobs={n_jobs}",
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.sampler.seed=0",
        "algo.lr=interval(1e-6,1e-5)",
        f"hydra.sweep.dir={sweep_dir}",
        *more,
    ]


def multirun_config(sweep_dir: Path) -> Any:
    """The config Hydra passes to `SweepSummaryCallback` for a multirun into `sweep_dir` (its basic launcher)."""
    launcher = {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}, "launcher": launcher}})


def summary_rows(sweep_dir: Path) -> list[dict[str, str]]:
    """The rows of the sweep's summary.csv, as strings."""
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


def run_job(
    sweep_dir: Path, folder: str, num: int, overrides: list[str], run: Callable[[Any], Any], **cfg: Any
) -> float | None:
    """run_sweep_job as Hydra calls it in job `num` (its HydraConfig faked: output folder `sweep_dir / folder`,
    task overrides `overrides`), with `run` as the training run; `cfg`: more of the job's config. Returns what
    run_sweep_job returns (the sweeper's objective, None for a failed trial)."""
    hc = OmegaConf.create(
        {
            "runtime": {"output_dir": str(sweep_dir / folder), "cwd": str(sweep_dir.parent)},
            "sweep": {"dir": str(sweep_dir)},
            "job": {"num": num},
            "overrides": {"task": overrides},
        }
    )
    job = {"experiment": "t", "cluster": {"max_concurrent": 0}, "tracking": {"group": None, "run_name": None}}
    with mock.patch("hydra.core.hydra_config.HydraConfig.get", return_value=hc):
        return sweep.run_sweep_job(OmegaConf.create({**job, **cfg}), run)
