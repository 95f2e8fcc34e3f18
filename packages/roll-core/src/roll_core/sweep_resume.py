"""A sweep resumed into an earlier sweep's folder (`pipeline.resume=true hydra.sweep.dir=<it>`): each job continues
its folder's run only when that run had the job's own swept values.

Contract: `check_resumed_folder` raises ConfigError for a job whose folder holds the checkpoints of an earlier sweep's
job with other values of the swept parameters (the overrides whose values differ between the folder's runs): Hydra
names job folders by job number, so values given in another order, or an Optuna trial sampling other values, would
continue another job's checkpoint with the job's own learning rate (a resume accepts a changed lr). Settings shared
by every job (`pipeline.max_steps`) may change. Every job in a folder with checkpoints records, as
`folder_overrides`, the overrides of the run those checkpoints belong to (roll_core.sweep's job records), also one
that never ran there (`record_folder_run`: not started after a stop, cancelled or killed before its start record):
its record replaced the folder's, and a later resume with its values continued the checkpoints of other ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
    sweep's run with other values of the swept parameters (overrides whose values differ between the folder's
    runs): Hydra names job folders by job number, so the job would continue another job's run. Any job in a folder
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
    differ = sorted(k for k, v in values.items() if len(v) > 1 and theirs.get(k) != mine.get(k))
    if differ:
        from roll_core.errors import ConfigError

        was = " ".join(f"{k}={theirs.get(k)}" for k in differ)
        now = " ".join(f"{k}={mine.get(k)}" for k in differ)
        raise ConfigError(
            f"pipeline.resume=true: {job_dir} holds the run of job {earlier.get('job')} of an earlier sweep, with "
            f"{was}; this job has {now} and would continue it. Hydra numbers job folders by job order: resume a "
            "sweep with its swept values in the same order, or give this sweep another hydra.sweep.dir"
        )
