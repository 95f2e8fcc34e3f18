"""A sweep's job records: each job's `job_status.json`, how it is written, found and labelled.

Contract: every job of a sweep (roll_core.sweep.run_sweep_job, roll's Ray launcher for a job whose process died)
leaves one record, `<job folder>/job_status.json` (`STATUS_FILE`): a JSON object with at least the job's number
(`job`), its Hydra task overrides (`overrides`, a list) and its `status` (running, ok, failed, killed, stopped),
and the id of the sweep it belongs to (`sweep_id`, from the sweep folder's sweep_id.json).

- `write_record` writes a record whole or not at all (a temporary file renamed over it): a process killed while
  writing never leaves half a record.
- `job_records` finds a sweep's records at any depth under its folder (job folders nest with
  `hydra.sweep.subdir=<a/b>`), sorted by job number; an unreadable record is a problem that counts as a failed job
  (never a silent gap), unless it is older than the sweep; records of another sweep run into the same folder are
  left out, with a warning.
- `job_labels` names each job by the overrides that differ between the jobs (the swept parameters), as the
  summary's `params`, `failed_jobs()` and a stopped sweep's stderr line do.

Reading and writing only: no sweep state of this process (roll_core.sweep holds that).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
STATUS_FILE = "job_status.json"


def write_record(job_dir: Path, record: dict[str, Any]) -> None:
    """Write a job's job_status.json whole or not at all (a temporary file renamed over it): a process killed while
    writing must not leave a half record the summary cannot read."""
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / f".{STATUS_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, job_dir / STATUS_FILE)


def _job_num(record: dict[str, Any]) -> int:
    try:
        return int(record["job"])
    except (KeyError, TypeError, ValueError):
        return 1 << 62  # a record without a job number: after the others


def job_records(
    sweep_dir: str | Path, sweep_id: str | None = None, started_at: float | None = None
) -> tuple[list[tuple[Path, dict[str, Any]]], list[str]]:
    """A sweep's job records, found at any depth under its folder and sorted by job number, as (job folder,
    record), and the problems that count as failed jobs (a job_status.json that cannot be read).

    With `sweep_id`, records of other sweeps (a sweep run again into the same folder) are left out with a warning;
    so is an unreadable record last written before `started_at`."""
    sweep_dir = Path(sweep_dir)
    found: list[tuple[Path, dict[str, Any]]] = []
    problems: list[str] = []
    stale: list[str] = []
    for path in sweep_dir.rglob(STATUS_FILE):  # rglob: job folders nest with hydra.sweep.subdir=<a/b>
        where = str(path.parent.relative_to(sweep_dir))
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict) or not isinstance(record.get("overrides"), list):
                raise ValueError("not a job record")
        except (OSError, ValueError) as exc:
            try:
                old = started_at is not None and path.stat().st_mtime < started_at
            except OSError:
                old = False
            if old:
                stale.append(where)
            else:  # a job of this sweep whose outcome is unknown: a failure, never a silent gap
                problems.append(f"{where}: unreadable {STATUS_FILE} ({exc})")
            continue
        if sweep_id is not None and record.get("sweep_id") != sweep_id:
            stale.append(where)
            continue
        found.append((path.parent, record))
    if stale:
        log.warning(
            "%d job record(s) in %s are from an earlier sweep into the same folder and are left out of this "
            "sweep's summary: %s",
            len(stale),
            sweep_dir,
            ", ".join(sorted(stale)),
        )
    found.sort(key=lambda item: (_job_num(item[1]), str(item[0])))
    return found, problems


def job_labels(records: list[dict[str, Any]]) -> list[str]:
    """Each job's label, as the summary's `params` and failed_jobs() name it: the overrides that differ between the
    jobs `records` (the swept parameters), not the shared ones."""
    values: dict[str, set[str]] = {}
    for st in records:
        for o in st["overrides"]:
            key, _, val = o.partition("=")
            values.setdefault(key, set()).add(val)
    swept = {k for k, v in values.items() if len(v) > 1 or len(records) == 1}
    return [
        " ".join(o for o in st["overrides"] if o.partition("=")[0] in swept) or f"job {st.get('job')}" for st in records
    ]
