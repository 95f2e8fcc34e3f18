"""roll-train (roll_core.cli.train_main, in this process, with the training run faked) when a sweep or a run cannot go
on: an Optuna sweep whose every trial failed still writes its summary and exits 1 naming it, and a run or sweep
launched into a folder another process is using is refused before Hydra writes anything into it."""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import roll_core.sweep as sweep
from roll_core import cli
from roll_core.run_lock import hold_run_folder
from roll_core.testing.held_folder import folder_held_elsewhere
from roll_core.testing.sweeps import optuna_sweep_args, reset_sweep_state, root_logging_restored


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    reset_sweep_state(monkeypatch)  # the sweeps and failures are per process: every test starts from none
    with root_logging_restored():
        yield


def _train(monkeypatch: pytest.MonkeyPatch, run: Any, *args: str) -> int:
    """roll-train `args` with `run` as the training run; returns its exit status."""
    monkeypatch.setattr(cli, "run_job", run)
    monkeypatch.setattr(sys, "argv", ["roll-train", *args])
    with pytest.raises(SystemExit) as exit_:
        cli.train_main()
    return int(exit_.value.code or 0)


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Path]:
    """A folder another live process holds the run-folder lock on, with what its run has written so far."""
    with folder_held_elsewhere(tmp_path / "run") as folder:
        yield folder


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# optuna 2.10 imports SQLAlchemy's declarative_base from its 1.x place: a deprecation warning, an error under pytest
@pytest.mark.filterwarnings("ignore:.*declarative_base:DeprecationWarning")
def test_an_optuna_sweep_whose_every_trial_failed_is_summarised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """hydra-optuna-sweeper asks the study for its best trial after the last one; with every trial failed Optuna
    raises "No trials are completed yet", Hydra skips on_multirun_end, and roll-train ended in that traceback with
    no summary of what failed. Now each job is summarised as failed with its error and roll-train exits 1 with one
    message naming the failures and summary.md."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="install roll-core[sweep]")
    sw = tmp_path / "sweep"

    def run(cfg: Any) -> dict[str, Any]:
        raise FileNotFoundError(f"no data for lr {cfg.algo.lr:.3g}")

    code = _train(monkeypatch, run, *optuna_sweep_args(sw, n_trials=2))

    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert (sw / "summary.csv").is_file(), err[-3000:]
    with open(sw / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "failed")]
    assert all(r["error"].startswith("FileNotFoundError: no data for lr ") for r in rows)
    assert "| failed |" in (sw / "summary.md").read_text()
    assert "roll-train: the sweep stopped (ValueError: No trials are completed yet.) after 2 job(s) failed" in err
    assert f"Each job's outcome and error: {sw / 'summary.md'}" in err
    assert "Traceback" not in err
    assert sweep.failed_jobs() == [r["params"] for r in rows]


def test_a_run_into_a_folder_in_use_leaves_it_untouched(
    held: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hydra writes .hydra/config.yaml (and opens the job log) in the run folder before the job runs, and the
    pipeline takes the folder's lock only when it is built: a second roll-train into a running run's folder replaced
    the running run's config record with its own, then was refused. Now it is refused before Hydra writes."""
    before = _tree(held)

    def run(cfg: Any) -> dict[str, Any]:  # what the pipeline does first (roll_core.pipelines.loop)
        hold_run_folder(cfg.pipeline.output_dir)
        raise AssertionError("the refused run must not start")

    code = _train(monkeypatch, run, f"pipeline.output_dir={held}", "algo.lr=3e-6")

    assert code == 2
    assert "is in use by another roll process" in capsys.readouterr().err
    assert _tree(held) == before


def test_a_sweep_into_a_sweep_folder_in_use_leaves_it_untouched(
    held: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep launched into a running sweep's folder replaced its sweep_id.json (the running sweep's later job
    records then carried the new id and were left out of its summary as stale) and its job folders' records before
    each job was refused: it is refused before anything is written."""
    (held / sweep.SWEEP_FILE).write_text('{"sweep_id": "running"}')
    before = _tree(held)

    def run(cfg: Any) -> dict[str, Any]:
        raise AssertionError("the refused sweep must not start a job")

    code = _train(monkeypatch, run, "-m", "algo.lr=1e-6,3e-6", f"hydra.sweep.dir={held}")

    assert code == 2
    assert "is in use by another roll process" in capsys.readouterr().err
    assert _tree(held) == before


def _stop_in_build(signum: int) -> None:
    """A real signal to this process while a pipeline is built (run_control.BuildStop: StoppedWhileBuilding)."""
    import os
    import time

    from roll_core.pipelines.run_control import BuildStop

    with BuildStop():
        os.kill(os.getpid(), signum)
        time.sleep(10)  # the handler raises before this ends
    raise AssertionError("no StoppedWhileBuilding")


@pytest.fixture
def default_sigterm() -> Iterator[None]:
    """SIGTERM at its default, as in a fresh roll-train process: an earlier test in this process may have left its own
    handler (ray.init installs one; under pytest-xdist it stayed), and these tests check that a sweep gives back the
    handler it found."""
    import signal

    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.usefixtures("default_sigterm")
def test_a_sweep_stopped_while_a_job_is_built_is_summarised_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM while job 1 of a local sweep builds its pipeline: StoppedWhileBuilding (a KeyboardInterrupt) went
    through the sweep, which exited 143 with job 1 `running`, job 2 without a record and no summary. Now job 1 is
    `stopped`, job 2 `not started`, the summary is written and roll-train exits 128+15; the sweep resumed into its
    folder runs the jobs again (each continues its folder's run) and exits 0."""
    import signal

    sw = tmp_path / "sweep"
    ran: list[float] = []

    def run(cfg: Any) -> dict[str, Any]:
        from hydra.core.hydra_config import HydraConfig

        ran.append(cfg.algo.lr)
        if cfg.algo.lr == 2e-6 and not cfg.pipeline.resume:
            _stop_in_build(signal.SIGTERM)
        (Path(HydraConfig.get().runtime.output_dir) / "checkpoints" / "step_1").mkdir(parents=True, exist_ok=True)
        return {"final_eval_accuracy": 0.5, "stopped_by_signal": None}

    lrs = "algo.lr=1e-6,2e-6,3e-6"
    assert _train(monkeypatch, run, "-m", lrs, f"hydra.sweep.dir={sw}") == 128 + signal.SIGTERM
    assert ran == [1e-6, 2e-6]
    rows = {r["job"]: r for r in csv.DictReader(open(sw / "summary.csv"))}
    assert [(j, r["status"]) for j, r in rows.items()] == [("0", "ok"), ("1", "stopped"), ("2", "stopped")]
    assert rows["1"]["error"] == "stopped while building the pipeline (SIGTERM)"
    assert rows["2"]["error"] == "not started: the sweep was stopped by signal 15 during job 1"
    assert "the sweep was stopped by signal 15 (SIGTERM)" in "".join(capsys.readouterr())  # Hydra logs to stdout
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the sweep's handlers are given back

    ran.clear()
    monkeypatch.setattr(sweep, "_failed_jobs", [])  # a new roll-train process
    monkeypatch.setattr(sys, "argv", ["roll-train", "-m", lrs, "pipeline.resume=true", f"hydra.sweep.dir={sw}"])
    cli.train_main()  # returns: exit 0
    assert ran == [1e-6, 2e-6, 3e-6]
    assert [r["status"] for r in csv.DictReader(open(sw / "summary.csv"))] == ["ok", "ok", "ok"]


# optuna 2.10 imports SQLAlchemy's declarative_base from its 1.x place: a deprecation warning, an error under pytest
@pytest.mark.filterwarnings("ignore:.*declarative_base:DeprecationWarning")
@pytest.mark.usefixtures("default_sigterm")
@pytest.mark.parametrize("where", ["in a trial", "between trials"])
def test_a_stopped_optuna_sweep_is_summarised_and_exits_128_plus_n(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop signal to an Optuna sweep. In a trial (its run's GracefulStop: the trial stops at a checkpoint), every
    later trial is `not started`, no trial completed, Optuna raised "No trials are completed yet" and roll-train
    exited 1 as for a sweep whose trials failed. Between trials (no run's handler: Hydra or the sampler at work), a
    SIGTERM killed the process outright: no summary. Both now exit 128+N with the summary of the trials that ran: the
    trial the sweeper asked next is not started and leaves no job folder (it was a `not started` job, and so was
    every remaining trial)."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="install roll-core[sweep]")
    import os
    import signal

    from roll_core.pipelines.run_control import GracefulStop

    sw = tmp_path / "sweep"
    ran: list[float] = []

    def run(cfg: Any) -> dict[str, Any]:
        ran.append(cfg.algo.lr)
        if where == "between trials":
            # this process's default SIGTERM would end pytest: the sweep's own handler must be there to take it
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None), "no sweep handler for SIGTERM"
            os.kill(os.getpid(), signal.SIGTERM)
            return {"final_eval_accuracy": 0.5, "stopped_by_signal": None}
        with GracefulStop() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"final_eval_accuracy": 0.1, "stopped_by_signal": stop.signum}

    code = _train(monkeypatch, run, *optuna_sweep_args(sw, n_trials=3))

    assert code == 128 + signal.SIGTERM
    assert len(ran) == 1
    rows = list(csv.DictReader(open(sw / "summary.csv")))
    first = "ok" if where == "between trials" else "stopped"
    assert [(r["job"], r["status"]) for r in rows] == [("0", first)]
    assert sorted(p.name for p in sw.iterdir() if p.is_dir()) == ["0"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _stopped_run(fail: int, stop: int) -> Any:
    """A training run for a sweep's jobs: job `fail` raises, job `stop` is stopped mid-run by a real SIGTERM (its
    GracefulStop: a checkpoint, as the pipeline's loop), the others finish with accuracy 0.5. Records the jobs run."""
    import os
    import signal

    from hydra.core.hydra_config import HydraConfig

    from roll_core.pipelines.run_control import GracefulStop

    def run(cfg: Any) -> dict[str, Any]:
        num = HydraConfig.get().job.num
        run.ran.append(num)  # type: ignore[attr-defined]
        if num == fail:
            raise FileNotFoundError(f"no data for job {num}")
        if num == stop:
            with GracefulStop() as graceful:
                os.kill(os.getpid(), signal.SIGTERM)
            return {"final_eval_accuracy": 0.1, "stopped_by_signal": graceful.signum}
        return {"final_eval_accuracy": 0.5, "stopped_by_signal": None}

    run.ran = []  # type: ignore[attr-defined]
    return run


def _roll_train_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("roll-train:")]


@pytest.mark.usefixtures("default_sigterm")
def test_a_stopped_sweep_says_which_of_its_jobs_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A local sweep (basic launcher) stopped by SIGTERM in job 2 after job 0 had failed: roll-train exited 143 with
    no word of the failed job (the stop's exit came before its "N sweep job(s) failed" line). Now one stderr line
    says the sweep was stopped, counts what its jobs did, names the failed one with its error and gives
    summary.md; the exit status stays 128+15."""
    import signal

    sw = tmp_path / "sweep"
    run = _stopped_run(fail=0, stop=2)
    code = _train(monkeypatch, run, "-m", "algo.lr=1e-6,2e-6,3e-6,4e-6", f"hydra.sweep.dir={sw}")

    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM
    assert run.ran == [0, 1, 2]
    rows = list(csv.DictReader(open(sw / "summary.csv")))
    assert [r["status"] for r in rows] == ["failed", "ok", "stopped", "stopped"]
    assert _roll_train_lines(err) == [
        "roll-train: the sweep was stopped by signal 15 (SIGTERM): 4 job(s): 1 finished, 1 failed, 1 stopped, "
        "1 not started. Failed: algo.lr=1e-06 (FileNotFoundError: no data for job 0). "
        f"Each job's outcome and error: {sw / 'summary.md'}"
    ]


def _kept_studies(monkeypatch: pytest.MonkeyPatch, optuna: Any) -> list[Any]:
    """The studies the Optuna sweeper creates from now on, kept for the test, all on one storage that outlives a
    sweep, as a persistent study (`hydra.sweeper.storage=sqlite:///...`) does: a later sweep with the same study
    name continues the study. An InMemoryStorage shared by the sweeps: optuna 2.10's RDB storage fails to open
    with the SQLAlchemy 2 installed here (its schema version check asserts)."""
    studies: list[Any] = []
    create_study, storage = optuna.create_study, optuna.storages.InMemoryStorage()

    def keep_study(*args: Any, **kwargs: Any) -> Any:
        studies.append(create_study(*args, **{**kwargs, "storage": storage, "study_name": "roll-test"}))
        return studies[-1]

    monkeypatch.setattr(optuna, "create_study", keep_study)
    return studies


def _job_dirs(sweep_dir: Path) -> list[str]:
    return sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())


# optuna 2.10 imports SQLAlchemy's declarative_base from its 1.x place: a deprecation warning, an error under pytest
@pytest.mark.filterwarnings("ignore:.*declarative_base:DeprecationWarning")
@pytest.mark.usefixtures("default_sigterm")
@pytest.mark.parametrize("completed", [True, False], ids=["a trial completed", "no trial completed"])
def test_a_stopped_optuna_sweep_records_agree_with_optunas_trials(
    completed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Optuna sweeper on the basic launcher, stopped by SIGTERM mid-trial after a trial failed: the trial that
    ran is `stopped` (a failed trial for Optuna: no value), the finished ones `ok`, one record per trial that ran,
    numbered as its trial, `ok` exactly where Optuna's trial is COMPLETE. The sweeper asks its next trial before
    roll sees it: that trial is not started, has no job folder and is never told (RUNNING), and no trial is asked
    after it. It was a `not started` job told as a FAILED trial, and so was every remaining trial, each with a
    folder. roll-train's one stderr line counts the jobs and names the failed trial; the exit status is 128+15."""
    optuna = pytest.importorskip("optuna")
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="install roll-core[sweep]")
    import signal

    studies = _kept_studies(monkeypatch, optuna)
    sw = tmp_path / "sweep"
    stop = 2 if completed else 1  # trial 0 fails; trial 1 finishes before the stop, or is the one stopped
    run = _stopped_run(fail=0, stop=stop)
    code = _train(monkeypatch, run, *optuna_sweep_args(sw, n_trials=5))

    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert run.ran == list(range(stop + 1))
    rows = list(csv.DictReader(open(sw / "summary.csv")))
    expected = ["failed"] + ["ok"] * (stop - 1) + ["stopped"]
    assert [(r["job"], r["status"]) for r in rows] == [(str(i), s) for i, s in enumerate(expected)]
    assert rows[stop]["error"] == "stopped by signal 15"
    (study,) = studies
    state = optuna.trial.TrialState
    ran, asked = study.trials[: stop + 1], study.trials[stop + 1 :]
    assert [t.number for t in ran] == [int(r["job"]) for r in rows]  # one record per trial that ran, its number
    assert [t.state == state.COMPLETE for t in ran] == [r["status"] == "ok" for r in rows]
    assert all(t.state in (state.COMPLETE, state.FAIL) for t in ran)
    assert [(t.number, t.state) for t in asked] == [(stop + 1, state.RUNNING)]  # no false FAIL, nothing asked after
    assert _job_dirs(sw) == [str(i) for i in range(stop + 1)]  # none for the trial that did not start
    # The best result so far, as hydra-optuna-sweeper writes it at its end (which the stop skipped): the completed
    # trial's values; no file when no trial completed (Optuna has no best trial)
    results = sw / "optimization_results.yaml"
    if completed:
        assert study.best_value == 0.5
        best = study.best_trial
        assert best.number == 1 and best.params["algo.lr"] == float(rows[1]["overrides"].partition("=")[2])
        assert yaml.safe_load(results.read_text()) == {
            "name": "optuna",
            "best_params": {"algo.lr": best.params["algo.lr"]},
            "best_value": 0.5,
        }
    else:
        assert not results.exists()
    # params of an Optuna sweep: each trial's sampled lr (every trial's differs)
    failed = f"{rows[0]['params']} (FileNotFoundError: no data for job 0)"
    assert _roll_train_lines(err) == [
        f"roll-train: the sweep was stopped by signal 15 (SIGTERM): {stop + 1} job(s): {stop - 1} finished, 1 failed, "
        f"1 stopped, 0 not started. Failed: {failed}. Each job's outcome and error: {sw / 'summary.md'}"
    ]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# optuna 2.10 imports SQLAlchemy's declarative_base from its 1.x place: a deprecation warning, an error under pytest
@pytest.mark.filterwarnings("ignore:.*declarative_base:DeprecationWarning")
@pytest.mark.usefixtures("default_sigterm")
def test_a_stopped_optuna_sweep_leaves_its_study_no_false_failure_and_the_study_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A study that outlives the sweep (a persistent one), 6 trials 2 at a time on the basic launcher, stopped by
    SIGTERM in trial 2, the first of the second batch (trial 0 failed, trial 1 finished). Trial 3, asked with trial
    2, is not started: it stays RUNNING in the study with no job folder, trial 2 is told (a failed trial, as every
    stopped job), and no third batch is asked. Before, trials 3 to 5 were each told FAILED (failures that never ran,
    kept by the study) and each got a job folder. The same study continued by a later sweep (same storage and study
    name, a new sweep folder) runs its new trials as jobs 4 and 5 (numbered after the study's trials); they
    complete, and trial 3 is still no failure."""
    optuna = pytest.importorskip("optuna")
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="install roll-core[sweep]")
    import json
    import signal

    studies = _kept_studies(monkeypatch, optuna)
    state = optuna.trial.TrialState
    sw, later = tmp_path / "sweep", tmp_path / "later"
    run = _stopped_run(fail=0, stop=2)
    code = _train(monkeypatch, run, *optuna_sweep_args(sw, n_trials=6, n_jobs=2))

    assert code == 128 + signal.SIGTERM
    assert run.ran == [0, 1, 2]
    assert [t.state for t in studies[0].trials] == [state.FAIL, state.COMPLETE, state.FAIL, state.RUNNING]
    assert [r["status"] for r in csv.DictReader(open(sw / "summary.csv"))] == ["failed", "ok", "stopped"]
    assert _job_dirs(sw) == ["0", "1", "2"]
    # the best so far (trial 1), saved though the stop left the sweeper before its own write
    best = yaml.safe_load((sw / "optimization_results.yaml").read_text())
    assert best == {"name": "optuna", "best_params": studies[0].trials[1].params, "best_value": 0.5}

    monkeypatch.setattr(sweep, "_failed_jobs", [])  # a new roll-train process, continuing the study
    run = _stopped_run(fail=-1, stop=-1)
    monkeypatch.setattr(cli, "run_job", run)
    monkeypatch.setattr(sys, "argv", ["roll-train", *optuna_sweep_args(later, n_trials=2)])
    cli.train_main()  # returns: exit 0

    assert run.ran == [4, 5]  # numbered after the study's 4 trials (sweep_optuna.watch_sweep): job N is trial N
    study = studies[-1]
    assert [t.state for t in study.trials] == [state.FAIL, state.COMPLETE, state.FAIL, state.RUNNING] + [
        state.COMPLETE
    ] * 2
    assert study.best_value == 0.5
    # the later sweep's jobs are the study's new trials (4 and 5), with the values Optuna sampled for them
    records = [json.loads((later / str(i) / sweep.STATUS_FILE).read_text()) for i in (4, 5)]
    assert [r["overrides"] for r in records] == [[f"algo.lr={t.params['algo.lr']}"] for t in study.trials[4:]]
    assert [r["status"] for r in records] == ["ok", "ok"]


# optuna 2.10 imports SQLAlchemy's declarative_base from its 1.x place: a deprecation warning, an error under pytest
@pytest.mark.filterwarnings("ignore:.*declarative_base:DeprecationWarning")
@pytest.mark.usefixtures("default_sigterm")
def test_a_stopped_optuna_sweep_resumed_into_its_folder_runs_its_trials_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pipeline.resume=true hydra.sweep.dir=<it>` after a stop in trial 1 of 3: the seeded sampler gives each
    trial its values again, trial 1 continues its folder's run (its checkpoint, same values: not refused) and
    trial 2, which had no folder, starts; the sweep exits 0."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="install roll-core[sweep]")
    import signal

    from hydra.core.hydra_config import HydraConfig

    from roll_core.pipelines.run_control import GracefulStop

    sw = tmp_path / "sweep"
    ran: list[tuple[int, float, bool]] = []

    def run(cfg: Any) -> dict[str, Any]:
        import os

        num = HydraConfig.get().job.num
        ran.append((num, cfg.algo.lr, bool(cfg.pipeline.resume)))
        (Path(HydraConfig.get().runtime.output_dir) / "checkpoints" / "step_1").mkdir(parents=True, exist_ok=True)
        if num == 1 and not cfg.pipeline.resume:
            with GracefulStop() as graceful:
                os.kill(os.getpid(), signal.SIGTERM)
            return {"final_eval_accuracy": 0.1, "stopped_by_signal": graceful.signum}
        return {"final_eval_accuracy": 0.5, "stopped_by_signal": None}

    args = optuna_sweep_args(sw, n_trials=3)
    assert _train(monkeypatch, run, *args) == 128 + signal.SIGTERM
    assert [num for num, _, _ in ran] == [0, 1] and _job_dirs(sw) == ["0", "1"]
    first = [lr for _, lr, _ in ran]

    ran.clear()
    monkeypatch.setattr(sweep, "_failed_jobs", [])  # a new roll-train process
    monkeypatch.setattr(sys, "argv", ["roll-train", *args, "pipeline.resume=true"])
    cli.train_main()  # returns: exit 0
    assert [(num, resumed) for num, _, resumed in ran] == [(0, True), (1, True), (2, True)]
    assert [lr for _, lr, _ in ran[:2]] == first
    assert [r["status"] for r in csv.DictReader(open(sw / "summary.csv"))] == ["ok", "ok", "ok"]
