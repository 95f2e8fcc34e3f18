"""A sweep resumed into an earlier sweep's folder (`pipeline.resume=true hydra.sweep.dir=<it>`): each job continues
its folder's run only when that run had the job's own settings.

Contract: `check_resumed_folder` raises ConfigError for a job whose folder holds the checkpoints of an earlier sweep's
job and whose overrides change a setting of that run (naming each setting with its old and new value): Hydra names
job folders by job number, so values given in another order, or an Optuna trial sampling other values, would
continue another job's checkpoint with the job's own learning rate (a resume accepts a changed lr). Which overrides
were swept cannot be told from the folder's records (an earlier sweep of one job has no setting that differs
between jobs), so any change is refused, except of the settings a resume is for (`RESUMABLE`: the run's length and
cadence, logging, the cluster) unless the earlier sweep swept them (their values differ between its job records).
Every job in a folder with checkpoints records, as `folder_overrides`, the overrides of the run those checkpoints
belong to (roll_core.sweep's job records), also one that never ran there (`record_folder_run`: not started after a
stop, cancelled or killed before its start record): its record replaced the folder's, and a later resume with its
values continued the checkpoints of other ones.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

#: Overrides (fnmatch patterns over the key) a resumed sweep may change in a job folder: how long and how often the
#: run goes on, what it logs, where it runs. Everything else (the learning rate, the algorithm, the data) would make
#: the folder's run another job's.
RESUMABLE = (
    "pipeline.max_steps",
    "pipeline.save_every",
    "pipeline.eval_every",
    "pipeline.keep_last",
    "pipeline.max_run_restarts",
    "pipeline.progress",
    "pipeline.trackers",
    "tracking.*",
    "cluster.*",
    "hydra.*",
)


def _swept(overrides: list[str]) -> dict[str, str]:
    # how a run is found is no part of what it trains: a sweep is resumed by adding these
    pairs = (o.lstrip("+~").partition("=") for o in overrides)
    return {k: v for k, _, v in pairs if k not in ("pipeline.resume", "pipeline.resume_from")}


def _folder_run(record: dict[str, Any]) -> dict[str, str]:
    # a job that continues (or is refused to continue) a folder's run records the overrides that run started with
    return _swept(record.get("folder_overrides") or record["overrides"])


def record_folder_run(job_dir: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """When `job_dir` holds checkpoints and the record of an earlier sweep's job, set `record["folder_overrides"]`
    (a job record of this sweep, about to replace that one) to the overrides of the run the checkpoints belong to,
    and return the earlier record; None (record untouched) otherwise. Run for every record that replaces a
    folder's: a job that never ran there must not leave its own values as what the folder holds."""
    from roll_core.sweep_records import STATUS_FILE

    if not any(job_dir.glob("checkpoints/*")):
        return None
    try:
        earlier = json.loads((job_dir / STATUS_FILE).read_text())
        _folder_run(earlier)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # no record of what the folder holds: nothing to keep
    if earlier.get("sweep_id") == record.get("sweep_id"):
        return None
    # what the folder holds stays its first run's, also after a resume with other shared settings (max_steps)
    record["folder_overrides"] = earlier.get("folder_overrides") or earlier["overrides"]
    return earlier


def check_resumed_folder(cfg: Any, job_dir: Path, sweep_dir: Path, record: dict[str, Any]) -> None:
    """Refuse a job of a resumed sweep (pipeline.resume=true) whose folder holds the checkpoints of an earlier
    sweep's run with other settings (any override but the `RESUMABLE` ones, and those too where the earlier sweep
    swept them): Hydra names job folders by job number, so the job would continue another job's run. Any job in a folder
    with checkpoints records, as `folder_overrides`, the overrides of the run they belong to."""
    from omegaconf import OmegaConf

    from roll_core.sweep_records import STATUS_FILE

    earlier = record_folder_run(job_dir, record)
    if earlier is None:
        return
    theirs = _folder_run(earlier)
    if not OmegaConf.select(cfg, "pipeline.resume", default=False):
        return  # the run refuses a folder with checkpoints (roll_core.pipelines.run_control)
    values: dict[str, set[str]] = {}
    for path in sweep_dir.rglob(STATUS_FILE):
        try:
            for k, v in _folder_run(json.loads(path.read_text())).items():
                values.setdefault(k, set()).add(v)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
    mine = _swept(record["overrides"])
    swept = {k for k, v in values.items() if len(v) > 1}
    # A setting only one side gives counts as changed (the other side has the config's default); with one job in the
    # earlier sweep nothing looks swept, and a changed lr was taken for a shared setting and continued silently.
    differ = sorted(
        k
        for k in theirs.keys() | mine.keys()
        if theirs.get(k) != mine.get(k) and (k in swept or not any(fnmatch.fnmatchcase(k, p) for p in RESUMABLE))
    )
    if differ:
        from roll_core.errors import ConfigError

        was = " ".join(f"{k}={_shown(theirs, k)}" for k in differ)
        now = " ".join(f"{k}={_shown(mine, k)}" for k in differ)
        raise ConfigError(
            f"pipeline.resume=true: {job_dir} holds the run of job {earlier.get('job')} of an earlier sweep, with "
            f"{was}; this job has {now} and would continue it. Hydra numbers job folders by job order: resume a "
            "sweep with its jobs' values in the same order and unchanged (only its length, cadence, logging and "
            "cluster may change), or give this sweep another hydra.sweep.dir"
        )


def _shown(overrides: dict[str, str], key: str) -> str:
    return overrides[key] if key in overrides else "(not given: the config's default)"
