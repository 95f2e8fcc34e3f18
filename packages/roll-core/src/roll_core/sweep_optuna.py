"""roll's additions to hydra-optuna-sweeper: persistent studies (`hydra.sweeper.storage=sqlite:///study.db`, or any
SQL URL) under SQLAlchemy 2, a continued study's job numbers, and the best result of a sweep a signal stopped
(`save_stopped_results`, below).

hydra-optuna-sweeper 1.3 requires optuna<3, and Optuna 2.x's database storage cannot set itself up under
SQLAlchemy 2 (which alembic 1.20, and so MLflow's SQL store, requires; SQLAlchemy 1.4 cannot be installed beside
it). `RDBStorage` records the schema's alembic revision with `MigrationContext.configure(engine.connect())` and
`stamp`, on a connection it never commits: SQLAlchemy 1.x autocommitted that INSERT, SQLAlchemy 2 has no autocommit
and rolls it back when the connection is discarded. Its schema check then finds no revision and fails
`assert version is not None` (storage.py, `_VersionManager.get_current_version`), so every `create_study` with a
storage URL failed, a new database or one it had written, and no study could be continued or shared.

Contract: `prepare_study_storage(sweeper)` (run by `SweepSummaryCallback.on_multirun_start`, before Hydra builds
the sweeper) does, for an Optuna sweeper with a SQL storage URL, what Optuna 2.x's storage set-up does (create the
tables and the version row) and records the alembic revision that Optuna would have recorded (the head revision,
or the base one for a database from before alembic), all in one transaction it commits. Optuna then finds its schema
recorded and opens the study as under SQLAlchemy 1.x: `load_if_exists` continues it (Optuna refuses one whose
direction differs with a ValueError). A storage without `study_name` gets one warning: Optuna then creates a new study
under a random name on every sweep, continuing none. Nothing is done for another
sweeper, no storage, a non-string storage, Optuna >= 3 or SQLAlchemy < 2 (those set themselves up), or a database
whose revision is already recorded (Optuna's own check then judges it, e.g. one from a newer Optuna). Everything
else Optuna 2.10 does with its storage works under SQLAlchemy 2 (trials, parameters, user attributes, intermediate
values, failed trials, summaries, deletion). The storage's set-up patches nothing: Optuna's files and classes are
left as they are.

The sweep's study (`watch_sweep`, run by `SweepSummaryCallback.on_multirun_start` for hydra-optuna-sweeper): for
the sweep only, the sweeper's `OptunaSweeperImpl.sweep` is wrapped, and while it runs `optuna.create_study`; the
first study it creates or loads is kept for the sweep, and both wrappers are removed when its `sweep()` ends.
roll found the study by the name of the sweeper's local variable (`study`) in stack frames, which a renamed
variable would have silently defeated. The shape the wrappers need (`OptunaSweeperImpl.sweep` calling
`optuna.create_study` and numbering jobs from `self.job_idx`) is checked at the sweep's start (`sweeper_problem`): a
sweeper without it runs as it is, after one warning saying what roll then cannot do.

A continued study's jobs: Hydra's job numbers (hence job folders, `hydra.sweep.subdir=${hydra.job.num}`) started at
0 in every sweep, so a study continued into the folder of its earlier sweep (same `hydra.sweeper.storage` and
`study_name`, same `hydra.sweep.dir`) wrote its jobs over the earlier sweep's job folders and records. A sweep
whose study already holds N trials numbers its jobs from N (the sweeper's `job_idx`): with one worker, job N is
trial N of the study, in any folder; the earlier jobs' folders are kept. A study in memory (no storage) starts
empty: its jobs are numbered from 0, as a resumed sweep (`pipeline.resume=true`) into its folder needs; a resumed
sweep of a persistent study asks new trials, into new folders (the study's earlier trials are not run again).
A continued study's seeded sampler (`hydra.sweeper.sampler.seed`) is made again with a seed derived from that seed
and the study's trial count (`reseed_continued`): the sampler restarted its random stream in every process, so the
continuing sweep asked exactly the earlier sweep's values. Its values are reproducible, but not those an
uninterrupted study of the same seed would have asked.

The direction (checked by the watched `sweep()` before its study is created): every roll-train job returns its
final held-out accuracy, so a sweep whose `hydra.sweeper.direction` is not `maximize` is refused with a ConfigError
(`direction_problem`): hydra-optuna-sweeper's default, `minimize`, made the study's best trial the worst one.

A stopped sweep's results: hydra-optuna-sweeper writes `<sweep folder>/optimization_results.yaml` (`name: optuna` and
`best_params`/`best_value`, or `solutions` for several objectives) at the end of its `sweep()`, which a sweep a
signal stopped leaves by roll_core.sweep_stop.SweepStopped (or a second signal's SystemExit): the best result so far
was lost. `save_stopped_results` (run by roll_core.sweep_stop.exit_stopped) writes that file, in the sweeper's format,
from the sweep's study (`take_study`), only when at least one trial of the study is COMPLETE (as the sweeper's own
`best_trial` requires; trials of an earlier sweep continuing the study count, as they do for the sweeper). No
completed trial, another sweeper, or one roll cannot follow: nothing is written (the last logged at the start).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("roll")

_OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper."
_SWEEPER_IMPL = "hydra_plugins.hydra_optuna_sweeper._impl"  # the module of OptunaSweeperImpl.sweep
RESULTS_FILE = "optimization_results.yaml"  # the name hydra-optuna-sweeper writes its results under
_studies: dict[str, Any] = {}  # resolved sweep folder -> the study its sweeper created or loaded (watch_sweep)
_patched: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, what it was, our wrapper) while a sweep is watched


def _major(version: str) -> int:
    """The major number of a version string (`2.10.1` -> 2)."""
    return int(version.split(".", 1)[0])


def storage_url(sweeper: Any) -> str | None:
    """The storage URL of the Hydra sweeper config `sweeper` (`hydra.sweeper`) when it is hydra-optuna-sweeper's
    and names one (a non-empty string); None otherwise."""
    if not sweeper:
        return None
    target = str(sweeper.get("_target_") or "")
    storage = sweeper.get("storage")
    if not target.startswith(_OPTUNA_SWEEPER) or not isinstance(storage, str) or not storage.strip():
        return None
    return storage


def needs_stamp() -> bool:
    """Whether the installed Optuna cannot record its own schema revision: Optuna < 3 under SQLAlchemy >= 2."""
    import optuna
    import sqlalchemy

    return _major(optuna.__version__) < 3 and _major(sqlalchemy.__version__) >= 2


def stamp_study_storage(url: str) -> str | None:
    """Set up the Optuna 2.x storage at `url` (SQLAlchemy URL) as `optuna.storages.RDBStorage` does (its tables, its
    version row) and record the alembic revision Optuna records (the head; the base for a database whose version row
    predates alembic), all in one committed transaction. Returns that revision, or None when one was already
    recorded (then nothing is written). Raises what SQLAlchemy raises for a URL it cannot open.

    RDBStorage itself is not built here: its set-up would leave its uncommitted INSERT of the revision on a discarded
    connection, which under SQLAlchemy 2.0 holds an SQLite database's write lock until it is garbage collected (the
    commit here then failed with "database is locked")."""
    import optuna
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from optuna.storages._rdb import models
    from sqlalchemy import create_engine, insert, select
    from sqlalchemy.pool import NullPool

    engine_kwargs: dict[str, Any] = {}
    rdb = optuna.storages.RDBStorage
    rdb._set_default_engine_kwargs_for_mysql(url, engine_kwargs)  # what Optuna passes for MySQL
    # NullPool: no connection (an SQLite file handle) is kept once this returns
    engine = create_engine(rdb._fill_storage_url_template(url), poolclass=NullPool, **engine_kwargs)
    script = ScriptDirectory(str(Path(models.__file__).parent / "alembic"))
    version_table = models.VersionInfoModel.__table__
    try:
        try:
            with engine.begin() as conn:  # committed on leaving the block
                models.BaseModel.metadata.create_all(conn)
                context = MigrationContext.configure(conn)
                if context.get_current_revision() is not None:
                    return None
                row = conn.execute(select(version_table.c.schema_version)).first()
                if row is None:  # a new database: Optuna's _init_version_info_model
                    conn.execute(
                        insert(version_table).values(
                            version_info_id=1,
                            schema_version=models.SCHEMA_VERSION,
                            library_version=optuna.__version__,
                        )
                    )
                # Optuna's _init_alembic: the head, or the base for a database from before alembic
                fresh = row is None or row.schema_version == models.SCHEMA_VERSION
                revision = script.get_current_head() if fresh else script.get_base()
                context.stamp(script, revision)
        except Exception:
            # Another worker sharing the study may have set it up first (our INSERTs then conflict): fine if so.
            with engine.connect() as conn:
                if MigrationContext.configure(conn).get_current_revision() is None:
                    raise
            return None
    finally:
        engine.dispose()
    log.info("Optuna storage %s: recorded its schema revision %s (Optuna 2.x under SQLAlchemy 2)", url, revision)
    return revision


def prepare_study_storage(sweeper: Any) -> str | None:
    """Before an Optuna sweep with `hydra.sweeper.storage` set (`sweeper`: the `hydra.sweeper` config): make its
    storage one Optuna 2.x can open under SQLAlchemy 2 (`stamp_study_storage`). Returns the revision recorded, None
    when nothing was needed."""
    url = storage_url(sweeper)
    if url is None:
        return None
    if not sweeper.get("study_name"):
        # Optuna's load_if_exists needs a name: without one every sweep silently made a new "no-name-<uuid>" study
        # in the storage, and a sweep meant to continue (or share) a study started from nothing.
        log.warning(
            "hydra.sweeper.storage=%s without hydra.sweeper.study_name: this sweep creates a new study named "
            "no-name-<uuid> and continues none; set hydra.sweeper.study_name to continue or share a study",
            url,
        )
    if not needs_stamp():
        return None
    return stamp_study_storage(url)


def sweeper_problem() -> str | None:
    """Why roll cannot follow the installed hydra-optuna-sweeper's study (`watch_sweep`), None when it can: its
    `OptunaSweeperImpl.sweep` must create or load the study with `optuna.create_study`, looked up on the `optuna`
    module when called (as `import optuna` then `optuna.create_study(...)` does), and number its jobs from
    `self.job_idx`, as hydra-optuna-sweeper 1.x does. Read from the method's bytecode: nothing is run."""
    import dis
    import itertools

    try:
        import optuna
        from hydra_plugins.hydra_optuna_sweeper import _impl
    except ImportError as exc:
        return f"{_SWEEPER_IMPL} cannot be imported ({exc})"
    sweep = getattr(getattr(_impl, "OptunaSweeperImpl", None), "sweep", None)
    if getattr(sweep, "__code__", None) is None:
        return f"{_SWEEPER_IMPL} has no OptunaSweeperImpl.sweep"
    steps = list(dis.get_instructions(sweep))
    # `optuna.create_study`: the global `optuna` (this optuna), then its attribute: a wrapper set on the module is met
    creates = any(
        (a.opname, a.argval, b.argval) == ("LOAD_GLOBAL", "optuna", "create_study")
        and b.opname in ("LOAD_ATTR", "LOAD_METHOD")
        for a, b in itertools.pairwise(steps)
    )
    if not creates or sweep.__globals__.get("optuna") is not optuna:
        return "OptunaSweeperImpl.sweep does not create its study with optuna.create_study"
    if "job_idx" not in sweep.__code__.co_names:
        return "OptunaSweeperImpl.sweep does not number its jobs from self.job_idx"
    return None


def watch_sweep(sweep_dir: str | Path, sweeper: Any) -> bool:
    """Before the Optuna sweep into `sweep_dir` (`sweeper`: the `hydra.sweeper` config; run by
    `SweepSummaryCallback.on_multirun_start`): wrap `OptunaSweeperImpl.sweep` for that sweep. While it runs,
    `optuna.create_study` is wrapped too: the first study it returns is the sweep's (kept for `take_study`) and, when
    it already holds trials (a continued study), the sweeper numbers its jobs after them (its `job_idx`), so job
    folders and records of earlier sweeps of the study in the same folder are never reused. Both wrappers are removed
    when the sweeper's `sweep()` ends (`unwatch`). Returns whether it is watched: False for another sweeper, and,
    with one warning, for a sweeper whose shape the wrappers cannot reach (`sweeper_problem`). Never raises."""
    unwatch()
    _studies.clear()
    target = str((sweeper or {}).get("_target_") or "")
    if not target.startswith(_OPTUNA_SWEEPER):
        return False
    try:
        problem = sweeper_problem()
        if problem is None:
            _install(Path(sweep_dir).resolve())
            return True
    except Exception as exc:  # bookkeeping: the sweep runs without it
        problem = f"{type(exc).__name__}: {exc}"
    log.warning(
        "roll cannot follow this hydra-optuna-sweeper's study (%s): a sweep a signal stops writes no %s, and a study "
        "continued into a sweep folder that has its earlier jobs reuses their job numbers and folders",
        problem,
        RESULTS_FILE,
    )
    return False


def _install(folder: Path) -> None:
    """Wrap OptunaSweeperImpl.sweep for the sweep into `folder` (see `watch_sweep`)."""
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

    sweep = OptunaSweeperImpl.sweep

    def watched_sweep(self: Any, arguments: Any) -> Any:
        create = optuna.create_study
        config = getattr(self, "config", None)

        def create_study(*args: Any, **kwargs: Any) -> Any:
            study = create(*args, **kwargs)
            if str(folder) not in _studies:  # the sweeper's, created before any job runs (a job's own comes later)
                _studies[str(folder)] = study
                done = len(study.get_trials(deepcopy=False))
                reseed_continued(study, _select(config, "hydra.sweeper.sampler"), done)
                if done > self.job_idx:  # from 0, they went into the folders of the study's earlier jobs
                    log.info(
                        "Optuna study %s holds %d trials: this sweep numbers its jobs after them",
                        study.study_name,
                        done,
                    )
                    self.job_idx = done
            return study

        optuna.create_study = create_study
        _patched.append((optuna, "create_study", create, create_study))
        try:
            # before the study is created: nothing asked, nothing run
            problem = direction_problem(getattr(self, "direction", _select(config, "hydra.sweeper.direction")))
            if problem is not None:
                from roll_core.errors import ConfigError

                raise ConfigError(problem)
            return sweep(self, arguments)
        finally:
            unwatch()

    OptunaSweeperImpl.sweep = watched_sweep
    _patched.append((OptunaSweeperImpl, "sweep", sweep, watched_sweep))


def _select(config: Any, key: str) -> Any:
    """`key` of the sweeper's multirun config `config` (None when there is none or it lacks the key)."""
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key) if config is not None else None


def direction_problem(direction: Any) -> str | None:
    """Why a roll-train sweep cannot optimise in `direction` (hydra.sweeper.direction: a name, an optuna-sweeper
    Direction, or a list of them), None for `maximize`. Each job returns one value, its final held-out accuracy,
    which is better higher: hydra-optuna-sweeper's default `minimize` searched for the worst settings (its best trial
    the lowest accuracy) without a word, and several objectives failed every trial (one value is not a list)."""
    from collections.abc import Sequence

    many = isinstance(direction, Sequence) and not isinstance(direction, str)
    names = [str(getattr(d, "name", d)) for d in (direction if many else [direction])]
    if names == ["maximize"]:
        return None
    given = f"[{','.join(names)}]" if many else names[0]
    why = (
        "the study would search for the worst settings (hydra-optuna-sweeper's default is minimize)"
        if names == ["minimize"]
        else "roll-train's sweep jobs return one value, to maximise"
    )
    return (
        f"hydra.sweeper.direction={given}: every roll-train sweep job returns its final held-out accuracy (higher "
        f"is better), so {why}. Set hydra.sweeper.direction=maximize"
    )


def continued_seed(seed: int, done: int) -> int:
    """The sampler seed for a study continued with `done` trials under `hydra.sweeper.sampler.seed=seed`: a
    function of both (reproducible), never the seed itself."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed), int(done)]).generate_state(1)[0])


def reseed_continued(study: Any, sampler: Any, done: int) -> bool:
    """Give the sweeper's `study`, continued with `done` (> 0) earlier trials, a sampler made from the sampler
    config `sampler` (`hydra.sweeper.sampler`) with `continued_seed`. A seeded sampler starts its random stream over
    in every process: the continuing sweep asked exactly the values the first sweep had asked (TPE's random start,
    a random sampler), trials run again under new numbers. Returns whether it reseeded: nothing for a new study, a
    sampler without a seed (it draws fresh entropy) or one that takes none (the grid sampler, which skips points
    the study holds)."""
    seed = sampler.get("seed") if done > 0 and sampler is not None and "seed" in sampler else None
    if seed is None:
        return False
    from hydra.utils import instantiate

    new_seed = continued_seed(seed, done)
    study.sampler = instantiate(sampler, seed=new_seed)
    log.info(
        "Optuna study %s continues after %d trials: its sampler is seeded %d (from hydra.sweeper.sampler.seed=%s "
        "and the trial count), not %s, so it does not ask the earlier sweep's values again",
        study.study_name,
        done,
        new_seed,
        seed,
        seed,
    )
    return True


def unwatch() -> None:
    """Remove what `watch_sweep` installed (where it is still in place); the study it kept stays for `take_study`."""
    while _patched:
        owner, name, old, ours = _patched.pop()
        if owner.__dict__.get(name) is ours:
            setattr(owner, name, old)


def take_study(sweep_dir: str | Path) -> Any | None:
    """The Optuna study the sweeper of the sweep into `sweep_dir` created or loaded (`watch_sweep`), handed over
    once; None when none was kept (another sweeper, one roll cannot follow, a sweep stopped before its study)."""
    return _studies.pop(str(Path(sweep_dir).resolve()), None)


def stopped_results(study: Any) -> dict[str, Any] | None:
    """What hydra-optuna-sweeper writes into optimization_results.yaml for `study` (`name`, `best_params` and
    `best_value`; `solutions`, each trial's `params` and `values`, on the Pareto front of a multi-objective study),
    from its COMPLETE trials; None when none is complete."""
    import optuna

    complete = optuna.trial.TrialState.COMPLETE
    if not any(t.state == complete for t in study.get_trials(deepcopy=False)):
        return None
    if len(study.directions) < 2:
        best = study.best_trial
        return {"name": "optuna", "best_params": best.params, "best_value": best.value}
    return {"name": "optuna", "solutions": [{"params": t.params, "values": t.values} for t in study.best_trials]}


def save_stopped_results(sweep_dir: str | Path) -> Path | None:
    """Write `<sweep_dir>/optimization_results.yaml` for an Optuna sweep a signal stopped, as hydra-optuna-sweeper
    writes it at the end of its `sweep()` (which the stop leaves by an exception), from the study of that sweep
    (`take_study`). Returns the file; None when no Optuna study was kept or none of its trials completed (then
    nothing is written). Bookkeeping of a sweep that is ending: a failure is logged, never raised."""
    try:
        study = take_study(sweep_dir)
        if study is None:
            return None
        results = stopped_results(study)
        if results is None:
            log.warning("the stopped Optuna sweep has no completed trial: no %s", RESULTS_FILE)
            return None
        from omegaconf import OmegaConf

        path = Path(sweep_dir) / RESULTS_FILE
        OmegaConf.save(OmegaConf.create(results), path)
    except Exception as exc:  # the stopped sweep must still end with its summary and exit status
        log.warning("could not write the %s of the stopped Optuna sweep in %s: %s", RESULTS_FILE, sweep_dir, exc)
        return None
    log.info("the stopped Optuna sweep's best result so far: %s", path)
    return path
