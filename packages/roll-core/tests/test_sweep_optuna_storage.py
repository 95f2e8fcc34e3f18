"""Persistent Optuna studies (`hydra.sweeper.storage=sqlite:///...`) with hydra-optuna-sweeper's Optuna 2.x under
SQLAlchemy 2 (roll_core.sweep_optuna): roll-train (roll_core.cli.train_main, in this process, the training run faked)
runs a sweep into a study database and a second sweep continues the same study; a database Optuna itself left
unusable is repaired; no other sweep is touched."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # optuna_sweeps, shared by the Optuna sweep tests
from optuna_sweeps import OPTUNA_SWEEPER, SQLALCHEMY_1_WARNINGS, optuna

from roll_core.sweep_optuna import needs_stamp, prepare_study_storage, storage_url
from roll_core.sweep_records import STATUS_FILE
from roll_core.testing.sweeps import optuna_sweep_args, summary_rows

# the sweeps and failures are per process: every test starts from none
pytestmark = [*SQLALCHEMY_1_WARNINGS, pytest.mark.usefixtures("fresh_sweep_state")]


@pytest.fixture
def sweep(roll_train: Callable[..., int], lr_scored_job: Any) -> Callable[[Path, str, list[float]], None]:
    """`sweep(sweep_dir, storage, ran)`: roll-train, a 2-trial Optuna sweep over algo.lr into `sweep_dir`, its study
    `roll` in `storage`; each job returns accuracy lr * 1e5 (in [0.1, 1]) and records its lr in `ran`. Returns when
    roll-train exits 0."""

    def run(sweep_dir: Path, storage: str, ran: list[float]) -> None:
        args = optuna_sweep_args(sweep_dir, 2, 1, f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=roll")
        code = roll_train(*args, job=lr_scored_job(ran))
        if code != 0:  # roll-train exits only on failure: show why
            pytest.fail(f"roll-train exited {code}")

    return run


def test_a_second_sweep_continues_the_study_in_its_sqlite_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sweep: Callable[[Path, str, list[float]], None]
) -> None:
    """Optuna 2.10's storage set-up never committed its schema revision under SQLAlchemy 2: every sweep with
    `hydra.sweeper.storage` failed at once with an AssertionError from inside Optuna, and no study could be kept or
    continued. Now the first sweep writes its 2 trials into the database and a second sweep (another folder, as a
    second worker or a later continuation) adds 2 more to the same study: Optuna holds 4 completed trials with the
    accuracies the jobs returned."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    ran: list[float] = []

    sweep(tmp_path / "sweep1", storage, ran)
    assert len(ran) == 2
    assert [r["status"] for r in summary_rows(tmp_path / "sweep1")] == ["ok", "ok"]
    monkeypatch.setattr("roll_core.sweep._failed_jobs", [])  # a new roll-train process
    sweep(tmp_path / "sweep2", storage, ran)
    assert len(ran) == 4
    assert [r["status"] for r in summary_rows(tmp_path / "sweep2")] == ["ok", "ok"]

    study = optuna.load_study(study_name="roll", storage=storage)
    assert [t.number for t in study.trials] == [0, 1, 2, 3]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert [t.params["algo.lr"] for t in study.trials] == pytest.approx(ran, rel=1e-12)
    assert [t.value for t in study.trials] == pytest.approx([lr * 1e5 for lr in ran], rel=1e-12)
    assert all(1e-6 <= lr <= 1e-5 for lr in ran)


def test_a_study_continued_into_its_sweep_folder_numbers_its_jobs_after_its_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sweep: Callable[[Path, str, list[float]], None]
) -> None:
    """A second sweep continuing the study into the first one's folder (same storage, study name and
    hydra.sweep.dir): Hydra numbered its jobs from 0 again, so they ran in folders 0 and 1 over the first sweep's
    jobs (their records and Hydra's config replaced: the first sweep's results lost from the folder). Now its jobs
    are numbered after the study's trials: folders 0 to 3 hold trials 0 to 3, each record with its own trial's
    value, and the second sweep's summary has its own two jobs."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    sw = tmp_path / "sweep"
    ran: list[float] = []

    sweep(sw, storage, ran)
    monkeypatch.setattr("roll_core.sweep._failed_jobs", [])  # a new roll-train process
    sweep(sw, storage, ran)

    study = optuna.load_study(study_name="roll", storage=storage)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
    assert sorted(p.name for p in sw.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    for trial in study.trials:  # job N is trial N: its record, its Hydra config, its value
        record = json.loads((sw / str(trial.number) / STATUS_FILE).read_text())
        assert (record["job"], record["status"]) == (trial.number, "ok")
        assert record["overrides"] == [f"algo.lr={trial.params['algo.lr']}"]
        assert record["summary"]["final_eval_accuracy"] == pytest.approx(trial.value, rel=1e-12)
        hydra_cfg = yaml.safe_load((sw / str(trial.number) / ".hydra" / "hydra.yaml").read_text())
        assert hydra_cfg["hydra"]["job"]["num"] == trial.number
    assert [t.params["algo.lr"] for t in study.trials] == pytest.approx(ran, rel=1e-12)
    assert [r["job"] for r in summary_rows(sw)] == ["2", "3"]  # the second sweep's own jobs


@pytest.mark.skipif(not needs_stamp(), reason="this Optuna sets up its own storage (Optuna >= 3 or SQLAlchemy < 2)")
def test_a_database_optuna_left_without_its_revision_is_repaired(tmp_path: Path) -> None:
    """Optuna's own create_study under SQLAlchemy 2 leaves its tables and version row but no alembic revision (its
    stamp rolled back), and every later open failed the same way. The preparation records the head revision in
    it, once: the study then opens and keeps its trials; a second preparation writes nothing."""
    db = tmp_path / "study.db"
    url = f"sqlite:///{db}"
    # Optuna 2.x under SQLAlchemy 2 as found, in another process (as a sweep that failed before): the bug itself
    made = f"import optuna; optuna.create_study(storage={url!r}, study_name='s')"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", made], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "assert version is not None" in proc.stderr, proc.stderr[-2000:]
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM version_info").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM alembic_version").fetchone() == (0,)

    sweeper = {"_target_": OPTUNA_SWEEPER, "storage": url}
    head = prepare_study_storage(sweeper)
    assert head == "v2.6.0.a"  # Optuna 2.10's head: what its own set-up records under SQLAlchemy 1.4
    study = optuna.create_study(storage=url, study_name="s", load_if_exists=True)
    study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=3)
    assert prepare_study_storage(sweeper) is None
    again = optuna.load_study(study_name="s", storage=url)
    assert [t.state for t in again.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("v2.6.0.a",)]


@pytest.mark.parametrize(
    "sweeper",
    [
        None,
        {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"},
        {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "storage": "sqlite:///x.db"},
        {"_target_": OPTUNA_SWEEPER, "storage": None},
        {"_target_": OPTUNA_SWEEPER, "storage": "  "},
    ],
)
def test_no_storage_is_prepared_for_another_sweeper_or_none(
    sweeper: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only hydra-optuna-sweeper with a storage URL is touched: nothing is created for Hydra's own sweeper (even one
    given a `storage` key) or an Optuna sweep without storage (Optuna keeps it in memory)."""
    monkeypatch.chdir(tmp_path)
    assert storage_url(sweeper) is None
    assert prepare_study_storage(sweeper) is None
    assert list(tmp_path.iterdir()) == []
