"""How trackers see a sweep (moved out of roll_core.sweep, which re-exports both names): each job's
`tracking.group` (unless given) is "<experiment>-<sweep folder>" (W&B group, MLflow experiment, SwanLab group) and its
`tracking.run_name` is "<experiment>-<job number>", so the jobs are distinct runs of one group. A run name given
without interpolation (`tracking.run_name=lr-scan`, or an experiment's own) is the same text in every job: it gets
"-<job number>" too (`lr-scan-1`), as the jobs were runs of one name in the tracker and told apart by nothing but
their start time; one with an interpolation (`tracking.run_name=lr${algo.lr}`, `run-${hydra:job.num}`) is the
user's naming per job, kept as it resolves.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


def sweep_group(experiment: str, sweep_dir: str | Path) -> str:
    """The tracker group of a sweep: "<experiment>-<sweep folder name>", with the date folder of Hydra's default
    layout (multirun/<date>/<time>) kept in it, so two days' sweeps started at the same time are two groups."""
    path = Path(sweep_dir)
    label = path.name
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", path.parent.name):
        label = f"{path.parent.name}_{label}"
    return f"{experiment}-{label}"


def sweep_tracking(cfg: Any, sweep_dir: str | Path, job_num: int) -> None:
    """Set a sweep job's `tracking.group` (the sweep's, shared, unless given) and `tracking.run_name` (the job's own:
    a name given without interpolation gets "-<job number>", the module docstring) on its composed config, in place;
    config.yaml then records both. `sweep_dir`: the sweep folder as an absolute path (roll_core.sweep.job_sweep_dir):
    hydra.sweep.dir as given (`.`, or relative to the date folder, as a resume may spell it) named another group than
    the sweep it resumes."""
    tracking = cfg.get("tracking") if hasattr(cfg, "get") else None
    if tracking is None:  # a config without the node (another primary config): nothing to name
        return
    experiment = str(cfg.get("experiment") or "sweep")
    if tracking.get("group") is None:
        tracking.group = sweep_group(experiment, sweep_dir)
    if tracking.get("run_name") is None:
        tracking.run_name = f"{experiment}-{job_num}"
    elif not OmegaConf.is_interpolation(tracking, "run_name"):
        tracking.run_name = f"{tracking.run_name}-{job_num}"
