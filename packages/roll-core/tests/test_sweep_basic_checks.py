"""roll-train sweeps on Hydra's default (basic) launcher check every job's config before the first job runs, as the
Ray launcher does (roll_core.sweep_checks): `-m algo.group_size=2,0` trained job 0 before job 1 failed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from roll_core import cli
from roll_core.testing.sweeps import reset_sweep_state, root_logging_restored


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    reset_sweep_state(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with root_logging_restored():
        yield


def _sweep(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, list[int]]:
    """roll-train `-m args` with the training run faked; its exit status and the group sizes of the jobs run."""
    ran: list[int] = []

    def run(cfg: Any) -> dict[str, Any]:
        ran.append(int(cfg.algo.group_size))
        return {"final_eval_accuracy": 0.5}

    monkeypatch.setattr(cli, "run_job", run)
    monkeypatch.setattr(sys, "argv", ["roll-train", "-m", *args])
    try:
        cli.train_main()
    except SystemExit as exc:  # a sweep whose jobs all ran and succeeded returns
        return int(exc.code or 0), ran
    return 0, ran


def test_a_bad_value_in_a_later_job_stops_the_sweep_before_any_job_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sw = tmp_path / "sweep"
    code, ran = _sweep(monkeypatch, "algo.group_size=2,0", f"hydra.sweep.dir={sw}")
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert ran == []  # job 0 did not train first
    assert not (sw / "0").exists() and not (sw / "1").exists()  # no job folder was made
    assert "sweep job 1 (algo.group_size=0" in err and "no job of this batch was started" in err
    assert "algo.group_size=0 must be >= 1" in err


def test_a_sweep_of_valid_jobs_runs_them_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sw = tmp_path / "sweep"
    code, ran = _sweep(monkeypatch, "algo.group_size=2,4", f"hydra.sweep.dir={sw}")
    assert (code, ran) == (0, [2, 4])
    assert (sw / "0").is_dir() and (sw / "1").is_dir()


def test_the_launcher_named_basic_is_rolls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hydra/launcher=basic` given on the command line is the checking launcher too (roll's YAML shadows Hydra's)."""
    sw = tmp_path / "sweep"
    code, ran = _sweep(monkeypatch, "hydra/launcher=basic", "+algo.nope=1,2", f"hydra.sweep.dir={sw}")
    assert (code, ran) == (2, [])
    assert not (sw / "0").exists()


def test_a_jobs_config_warning_is_logged_once_per_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The batch check composes and checks every job's config, and each job checks its own again when it runs in
    this process: the check's warnings (here the near-greedy group temperature) came twice per job."""
    from roll_core.config.compose import to_object

    ran: list[int] = []

    def run(cfg: Any) -> dict[str, Any]:
        ran.append(int(to_object(cfg).algo.group_size))  # the job's own check, as cli.run_job makes it
        return {"final_eval_accuracy": 0.5}

    monkeypatch.setattr(cli, "run_job", run)
    sw = tmp_path / "sweep"
    args = ["algo.group_size=2,4", "infer_engine.temperature=0.01", f"hydra.sweep.dir={sw}"]
    monkeypatch.setattr(sys, "argv", ["roll-train", "-m", *args])
    try:
        cli.train_main()
    except SystemExit as exc:
        assert not exc.code
    assert ran == [2, 4]
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert said.count("infer_engine.temperature=0.01 with algo.adv_estimator=") == 2, said[-3000:]
