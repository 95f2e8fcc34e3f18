"""The run folder's own MLflow store (roll_core.trackers.mlflow: `sqlite:///<run>/mlflow/mlflow.db`, artifacts in
`<run>/mlflow/artifacts`) after the folder moved (a sweep folder renamed or moved, a folder reached through another
mount point): `follow_folder` makes its artifacts follow the folder.

MLflow keeps absolute locations: an experiment's `artifact_location` (roll sets `file://<run>/mlflow/artifacts`) and,
from it, each run's `artifact_uri` (`<location>/<run id>/artifacts`), fixed when the run was created. The SQLite file
moves with the folder, those paths do not: a resumed run's config.yaml and sample tables were written under the
folder's OLD path (making that folder again, or failing where it cannot be written), and the UI read every run's
artifacts from there. `follow_folder` rewrites, in the store's database, the locations under a run folder's
artifacts (`.../mlflow/artifacts`) that is not `artifacts` to name `artifacts` instead; the files moved with the
folder, so every run of the store, superseded ones too, finds its artifacts again. Locations elsewhere (an
experiment someone created by hand in this database) are left as they are. Contract: called before the store is
used by this process's MLflow client (the tracker's construction); a database without MLflow's tables (not created
yet) is left as it is, one that cannot be read or written is warned about (never raised: the tracker's own writes
say what fails); returns how many experiments were moved.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

__all__ = ["ARTIFACTS_TAIL", "follow_folder"]

log = logging.getLogger("roll_core.trackers.mlflow")  # the backend's logger: all its messages under one name
#: How the artifact location roll gives a run folder's own store ends.
ARTIFACTS_TAIL = "/mlflow/artifacts"


def follow_folder(db: Path, artifacts: Path) -> int:
    """Point the locations of the store in `db` that name another run folder's artifacts at `artifacts` (the module
    docstring); the number of experiments moved."""
    if not db.is_file():
        return 0
    new = artifacts.resolve().as_uri()
    connection = sqlite3.connect(db, timeout=30)  # (MLflow's own timeout for a busy SQLite store is shorter)
    try:
        with connection:  # one transaction: every location moved, or none
            rows = connection.execute("SELECT experiment_id, artifact_location FROM experiments").fetchall()
            moved = [(i, old) for i, old in rows if _other_folder(old, new)]
            runs: list[str] = []  # (this process's MLflow keeps a repository per run: `_forget_repositories`)
            for experiment_id, old in moved:
                query = "SELECT run_uuid FROM runs WHERE experiment_id = ?"
                runs.extend(run_id for (run_id,) in connection.execute(query, (experiment_id,)))
                connection.execute(
                    "UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new, experiment_id)
                )
                # each run's own location is the experiment's then, with `/<run id>/artifacts` after it
                connection.execute(
                    "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
                    "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
                    (new, len(old) + 1, experiment_id, len(old) + 1, old + "/"),
                )
    except sqlite3.Error as exc:
        # no tables yet (MLflow creates them with its first call): nothing to move; else the tracker's own writes
        # fail the same way, and say so (roll_core.trackers.mlflow: a local store that cannot be written)
        if "no such table" not in str(exc):
            log.warning("MLflow: %s: the artifact locations were not checked (%s: %s)", db, type(exc).__name__, exc)
        return 0
    finally:
        connection.close()
    _forget_repositories(runs)
    for _, old in moved:
        log.info("MLflow: the run folder moved: artifacts of %s are now read and written in %s", old, new)
    return len(moved)


def _other_folder(location: object, new: str) -> bool:
    """Whether an experiment's location names a run folder's artifacts other than `new`."""
    return (
        isinstance(location, str)
        and location != new
        and location.startswith("file://")
        and (location.endswith(ARTIFACTS_TAIL))
    )


def _forget_repositories(run_ids: list[str]) -> None:
    """Drop this process's MLflow artifact repositories of `run_ids`: MLflow keeps one per run for the process
    (`_artifact_repos_cache`, at the location the run had), and a run reopened in the process that created it (a
    resume in-process) wrote to the old folder."""
    try:
        from mlflow.tracking._tracking_service import utils
    except ImportError:  # (another layout: no such cache to clear)
        return
    cache = getattr(utils, "_artifact_repos_cache", None)
    for run_id in run_ids if cache is not None else ():
        cache.pop(run_id, None)
