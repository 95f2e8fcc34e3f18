"""A sweep job whose folder already holds another job of its sweep: refused without touching that job's record.

Why: `hydra.sweep.subdir=${hydra.job.override_dirname}` with a repeated value (`algo.lr=1e-3,1e-3`, an Optuna trial
that samples a point again) gives two jobs one folder. roll's Ray launcher refuses that before any job starts
(roll_core.sweep_launcher.check_job_folders); Hydra's basic launcher has no hook that sees every job first, so the
check is the job's own (roll_core.sweep.run_sweep_job). Without it the second job wrote its job_status.json over the
first's before its run refused the folder, and the first job dropped out of the summary; with pipeline.resume=true it
continued the first job's finished run and recorded it under its own values.

Contract:
- `folder_owner` returns the record in a job's folder that belongs to another job of the same sweep (the same
  `sweep_id`, another job number or other overrides), else None. A record of an earlier sweep is no clash: a resumed
  sweep continues its folders (roll_core.sweep_resume checks their settings), and folders named by overrides match
  jobs across sweeps by their values, not their numbers. The same job again (same number and overrides: a retried
  task) is no clash either. Without a sweep id (no sweep_id.json: no SweepSummaryCallback) sweeps cannot be told
  apart and nothing is refused.
- A refused job records its failure in `refused_folder` (`<sweep folder>/refused_jobs/job_<number>`), where the
  summary finds it under its own number; nothing in the shared folder is written by roll (Hydra has already written
  its `.hydra/` configs and job log there before the job runs: that is outside roll's reach).
- `claim_folder` makes that check atomic across processes (a parallel launcher such as joblib, or jobs queued for a
  `cluster.max_concurrent` slot, all pass `folder_owner` before any writes its record): the first job of a sweep to
  hard-link its claim file (`.roll_claim_<sweep_id>.json`, whole before it appears) into a folder owns it; a later
  job of the sweep finds that claim and is refused. The same job again finds its own claim and goes on.
`folder_owner` only reads; `claim_folder` writes the claim file and nothing else: the caller writes the record.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from roll_core.sweep_records import STATUS_FILE

#: Under the sweep folder: where a job refused for sharing another job's folder leaves its record.
REFUSED_DIR = "refused_jobs"


def folder_owner(job_dir: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """The record in `job_dir` of another job of the sweep `record` (this job's record: `job`, `overrides`,
    `sweep_id`) belongs to, or None: no record, an unreadable one, an earlier sweep's, or this same job's."""
    if record.get("sweep_id") is None:
        return None
    try:
        earlier = json.loads((job_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None  # written whole or not at all (sweep_records.write_record): nothing to tell apart
    if not isinstance(earlier, dict) or earlier.get("sweep_id") != record["sweep_id"]:
        return None
    return None if _same_job(earlier, record) else earlier


def _same_job(earlier: dict[str, Any], record: dict[str, Any]) -> bool:
    return str(earlier.get("job")) == str(record.get("job")) and list(earlier.get("overrides") or []) == list(
        record.get("overrides") or []
    )


def claim_folder(job_dir: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """Claim `job_dir` for job `record` (`job`, `overrides`, `sweep_id`) of its sweep, atomically: None when the claim
    is this job's (made now, or earlier by this same job), else the claim of the other job of the sweep that made it
    first (its `job` and `overrides`). Without a sweep id nothing is claimed (None). The claim is written to a
    temporary file and hard-linked into place: a link fails when the name exists, so of two jobs racing for a folder
    exactly one wins, and a reader never sees a half-written claim."""
    sweep_id = record.get("sweep_id")
    if sweep_id is None:
        return None
    job_dir.mkdir(parents=True, exist_ok=True)
    claim = job_dir / f".roll_claim_{sweep_id}.json"
    mine = {"job": record.get("job"), "overrides": list(record.get("overrides") or []), "sweep_id": sweep_id}
    fd, tmp = tempfile.mkstemp(dir=job_dir, prefix=".roll_claim_", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        try:
            os.link(tmp, claim)
            return None
        except FileExistsError:
            pass
        except OSError:  # a filesystem without hard links (some FUSE mounts): an exclusive create is atomic too
            try:
                with open(claim, "x") as f:
                    json.dump(mine, f)
                return None
            except FileExistsError:
                pass
    finally:
        os.unlink(tmp)
    try:
        earlier = json.loads(claim.read_text())
    except (OSError, ValueError):
        earlier = {}
    if not isinstance(earlier, dict):
        earlier = {}
    return None if _same_job(earlier, record) else {"job": earlier.get("job"), "overrides": earlier.get("overrides")}


def refused_folder(sweep_dir: Path, job_num: Any) -> Path:
    """Where job `job_num` of the sweep in `sweep_dir` records that it was refused for another job's folder: its own
    folder under the sweep folder, found by the summary (it looks at any depth) and named by the job's number."""
    return sweep_dir / REFUSED_DIR / f"job_{job_num}"


def shared_folder_error(job_dir: Path, record: dict[str, Any], owner: dict[str, Any], where: Path) -> str:
    """The error of job `record` refused because `job_dir` holds job `owner`'s record; `where`: its own record's
    folder. Names both jobs, what the folder holds, and how to give every job its own folder."""

    def named(r: dict[str, Any]) -> str:
        return f"job {r.get('job')} ({' '.join(str(o) for o in r.get('overrides') or []) or 'no overrides'})"

    return (
        f"sweep {named(record)} was given the folder {job_dir} of {named(owner)} of the same sweep "
        f"(hydra.sweep.subdir resolves alike for both): it was not run, so it neither replaces nor continues that "
        f"job's record and run (this record is in {where}). Give every job its own folder: distinct values (a "
        "repeated value such as algo.lr=1e-3,1e-3 is one folder with hydra.job.override_dirname; an Optuna trial may "
        "sample a point again), or a numbered subdir, e.g. "
        "hydra.sweep.subdir=${hydra.job.num}_${hydra.job.override_dirname}"
    )
