"""How trackers see a sweep's jobs (roll_core._sweep_tracking through roll_core.sweep.run_sweep_job): one group per
sweep folder whatever the spelling of `hydra.sweep.dir`, one run name per job (a name given too). Each job is
run_sweep_job with a fake `run` that reads the config it is handed (HydraConfig faked as Hydra sets it in a multirun
job)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from omegaconf import OmegaConf

import roll_core.sweep as sweep
from roll_core.testing.sweeps import multirun_config, reset_sweep_state


@pytest.fixture(autouse=True)
def _fresh_sweep_state(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_sweep_state(monkeypatch)


def _tracking_of_job(cwd: Path, sweep_dir: str, num: int, **tracking: Any) -> dict[str, Any]:
    """The `tracking` node job `num` of a sweep into `sweep_dir` (as given on the command line, relative to `cwd`)
    runs with."""
    folder = Path(cwd, sweep_dir).resolve()
    hc = OmegaConf.create(
        {
            "runtime": {"output_dir": str(folder / str(num)), "cwd": str(cwd)},
            "sweep": {"dir": sweep_dir},
            "job": {"num": num},
            "overrides": {"task": [f"algo.lr={num}e-3"]},
        }
    )
    seen: dict[str, Any] = {}

    def run(cfg: Any) -> dict[str, Any]:
        seen.update(OmegaConf.to_container(cfg.tracking, resolve=True))
        return {"final_eval_accuracy": 0.5}

    base = {"group": None, "run_name": None, **tracking}
    cfg = OmegaConf.create({"experiment": "t", "cluster": {"max_concurrent": 0}, "tracking": base})
    with mock.patch("hydra.core.hydra_config.HydraConfig.get", return_value=hc):
        assert sweep.run_sweep_job(cfg, run) == 0.5
    return seen


def test_a_sweep_is_one_group_however_its_folder_is_spelled(tmp_path: Path) -> None:
    """A sweep resumed from inside its date folder (`hydra.sweep.dir=12-00-00`) or its own folder
    (`hydra.sweep.dir=.`) was another group than the sweep it resumes (`t-12-00-00`, `t-` for
    `t-2024-05-01_12-00-00`): the group was read from the text of hydra.sweep.dir, not the folder it names, so the
    resumed jobs' MLflow runs went to another experiment and their W&B runs to another group. Every spelling of one
    folder is one group; the run name is the job's."""
    day = tmp_path / "multirun" / "2024-05-01"
    (day / "12-00-00").mkdir(parents=True)
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(multirun_config(day / "12-00-00"))
    spellings = [
        (tmp_path, "multirun/2024-05-01/12-00-00"),  # Hydra's default, relative to where roll-train started
        (tmp_path, str(day / "12-00-00")),
        (day, "12-00-00"),
        (day / "12-00-00", "."),
        (day / "12-00-00", "../12-00-00/"),
    ]
    for n, (cwd, spelled) in enumerate(spellings):
        assert _tracking_of_job(cwd, spelled, n) == {"group": "t-2024-05-01_12-00-00", "run_name": f"t-{n}"}, spelled


def test_a_group_given_is_kept_and_a_name_given_is_each_jobs_own(tmp_path: Path) -> None:
    """`tracking.group` given on the command line is the jobs', as it is. A plain `tracking.run_name=mine` named
    every job `mine`, with no warning: the sweep's runs were told apart by nothing but their start time. Each job's
    is `mine-<job number>` now, as the default `<experiment>-<job number>`; a name with an interpolation is the user's
    naming per job, kept as the job resolves it."""
    (tmp_path / "sw").mkdir()
    sweep.SweepSummaryCallback().on_multirun_start(multirun_config(tmp_path / "sw"))
    assert _tracking_of_job(tmp_path, "sw", 1, group="lr-scan") == {"group": "lr-scan", "run_name": "t-1"}
    named = [_tracking_of_job(tmp_path, "sw", n, run_name="mine") for n in (2, 3)]
    assert named == [{"group": "t-sw", "run_name": "mine-2"}, {"group": "t-sw", "run_name": "mine-3"}]
    interpolated = _tracking_of_job(tmp_path, "sw", 4, run_name="${experiment}-c${cluster.max_concurrent}")
    assert interpolated == {"group": "t-sw", "run_name": "t-c0"}
