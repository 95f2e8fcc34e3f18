"""Where a run's MLflow artifacts live in a store on this machine's disk: the run folder's own store
(roll_core.trackers.mlflow: `sqlite:///<run>/mlflow/mlflow.db`, artifacts in `<run>/mlflow/artifacts`) after the
folder moved (a sweep folder renamed or moved, a folder reached through another mount point): `follow_folder` makes
its artifacts follow the folder; a store several run folders share: `own_artifacts` keeps each run's in its own.

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

A store several run folders share (a sweep's jobs with one `sqlite:`/`file:`/database tracking URI, one experiment:
`tracking.group`): the experiment's location is the run folder of the job that created it, and MLflow puts every
run's artifacts under its experiment's, so every job's config.yaml and sample tables went into that first job's
folder (and went with it: deleted, moved, read-only). `own_artifacts` gives a new run whose location is under
another run folder's artifacts its own folder's (`<run>/mlflow/artifacts/<run id>/artifacts`), in the store's
record of the run (MLflow has no call for it: its SQL store's table, its file store's meta.yaml). A location the
user chose (an experiment not made by roll) is left as it is, also where it ends as a run folder's does
(`<team>/mlflow/artifacts`): roll tags the experiments it makes with a run folder's location (ROLL_LOCATION_TAG),
and one made before that tag is taken for roll's only when that run folder records an MLflow run
(`<run>/mlflow/run.json`). One of a store roll cannot change (another kind) is left as it is too: said once, as a
warning naming where the artifacts go. Contract: called right after the run is created,
before anything is logged to it; the store's own errors are raised (the tracker's `_start` says what fails).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = ["ARTIFACTS_TAIL", "ROLL_LOCATION_TAG", "follow_folder", "own_artifacts"]

log = logging.getLogger("roll_core.trackers.mlflow")  # the backend's logger: all its messages under one name
#: How the artifact location roll gives a run folder's own store ends.
ARTIFACTS_TAIL = "/mlflow/artifacts"
#: The tag of an experiment roll made with a run folder's artifacts as its location (`own_artifacts` moves its runs').
ROLL_LOCATION_TAG = "roll.artifact_location"


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


def own_artifacts(client: Any, run: Any, artifacts: Path) -> str:
    """Make the artifact location of the new `run` (of `client`'s store) `artifacts`' when it is under another run
    folder's artifacts (the module docstring); the run's location, as it is now."""
    info = run.info
    location, tail = str(info.artifact_uri or ""), f"/{info.run_id}/artifacts"
    root, new_root = location.removesuffix(tail), artifacts.resolve().as_uri()
    if root == location or not _other_folder(root, new_root) or not _made_by_roll(client, info.experiment_id, root):
        return location  # its own folder already, or a location the user chose
    new = new_root + tail
    from mlflow.store.tracking.file_store import FileStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = client._tracking_client.store
    if isinstance(store, SqlAlchemyStore):
        from mlflow.store.tracking.dbmodels.models import SqlRun

        with store.ManagedSessionMaker() as session:
            session.query(SqlRun).filter(SqlRun.run_uuid == info.run_id).update({SqlRun.artifact_uri: new})
    elif isinstance(store, FileStore):
        record = store._get_run_info(info.run_id)
        record._artifact_uri = new
        store._overwrite_run_info(record)
    else:
        _warn_shared(type(store).__name__, root)
        return location
    _forget_repositories([info.run_id])
    return new


def _made_by_roll(client: Any, experiment_id: str, root: str) -> bool:
    """Whether the experiment's location `root` (a run folder's artifacts, by its name) is one roll gave it: tagged
    so (ROLL_LOCATION_TAG), or, made before that tag, in a folder that records an MLflow run (run.json); not a
    location a user chose that ends the same way."""
    experiment = client.get_experiment(experiment_id)
    if experiment.tags.get(ROLL_LOCATION_TAG) == root:
        return True
    folder = Path(unquote(urlparse(root).path)).parent  # `<run>/mlflow`
    return (folder / "run.json").is_file()


_warned: set[str] = set()  # the stores `_warn_shared` warned about (once per process each)


def _warn_shared(kind: str, root: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(
            "MLflow: runs of this %s store keep their artifacts under %s, another run folder's (its experiment's "
            "location): roll cannot give a run its own folder's in this kind of store",
            *(kind, root),
        )


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
