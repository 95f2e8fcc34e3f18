"""roll's Ray launcher refuses a batch of sweep jobs before any starts (roll_core.sweep_checks), with Ray left out:
a job whose config roll refuses (an unknown key forced in with `+`, a value a schema refuses), a job task asking for
more than any node has. Also: a resumed sweep keeps its job folders under hydra.sweep.subdir=override_dirname."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf, open_dict

from roll_core.errors import ConfigError
from roll_core.testing.sweeps import reset_sweep_state


@pytest.fixture(autouse=True)
def _fresh_sweep_state(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_sweep_state(monkeypatch)


@pytest.fixture
def no_ray_launch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """roll's Ray launcher with Ray left out: the job configs it would launch, stopping at the first; one node of
    2 CPUs and no GPU."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="install roll-core[sweep]")
    from roll_core import sweep_checks, sweep_launcher

    launched: list[Any] = []

    def launch(context: Any, remote: Any, cfg: Any, task: Any, state: Any) -> None:
        launched.append(cfg)
        raise RuntimeError("launched")

    monkeypatch.setattr(sweep_launcher, "launch_job_on_ray", launch)
    monkeypatch.setattr(sweep_launcher, "start_ray", lambda init: None)
    monkeypatch.setattr(sweep_launcher, "configure_log", lambda *args: None)
    monkeypatch.setattr(sweep_launcher, "remove_slots", lambda sweep_dir: None)
    monkeypatch.setattr(sweep_checks, "_node_resources", lambda: [{"CPU": 2.0, "memory": 4e9}])
    return launched


def _launcher(sweep_dir: Path, remote: dict[str, Any] | None = None, init: dict[str, Any] | None = None) -> Any:
    """A RayLauncher as Hydra sets it up, whose jobs compose roll's real config (rlvr) with their overrides."""
    from hydra.conf import HydraConf

    from roll_core.config.compose import compose

    hydra = OmegaConf.structured(HydraConf)  # typed as Hydra makes it: a job's `${hydra:...}` resolves against it
    hydra.sweep.dir = str(sweep_dir)
    hydra.hydra_logging, hydra.verbose = {}, False
    base = OmegaConf.create({"hydra": hydra})

    def load_sweep_config(config: Any, overrides: list[str]) -> Any:
        cfg = compose(overrides)
        with open_dict(cfg):
            cfg.hydra = OmegaConf.structured(HydraConf)
            cfg.hydra.sweep.dir = str(sweep_dir)
        return cfg

    return SimpleNamespace(
        config=base,
        hydra_context=SimpleNamespace(config_loader=SimpleNamespace(load_sweep_config=load_sweep_config)),
        task_function=lambda cfg: None,
        ray_cfg=OmegaConf.create({"init": init or {"address": None}, "remote": remote or {"num_cpus": 0}}),
    )


def test_a_job_config_roll_refuses_stops_the_sweep_before_any_job_starts(
    tmp_path: Path, no_ray_launch: list[Any]
) -> None:
    """`+algo.bogus=1` passes Hydra's composition (a `+` key bypasses struct mode) and `algo.lr=1e-3,-1` composes
    too; roll refused both only inside the job, so every job was started to fail, or job 1 failed after job 0 had
    trained. Now the launcher refuses the batch before any job starts, naming the job, its overrides and the key."""
    from roll_core import sweep_launcher

    launcher = _launcher(tmp_path / "s1")
    with pytest.raises(ConfigError, match=r"(?s)sweep job 0 \(algo.lr=1e-3 \+algo.bogus=1\).*Key 'bogus' not in"):
        sweep_launcher.launch_jobs(launcher, [["algo.lr=1e-3", "+algo.bogus=1"], ["algo.lr=3e-3", "+algo.bogus=1"]], 0)
    with pytest.raises(ConfigError, match=r"(?s)sweep job 1 \(algo.lr=-1\).*algo.lr=-1.0 must be > 0"):
        sweep_launcher.launch_jobs(_launcher(tmp_path / "s2"), [["algo.lr=1e-3"], ["algo.lr=-1"]], 0)
    assert no_ray_launch == []

    with pytest.raises(RuntimeError, match="launched"):  # valid configs: the jobs start
        sweep_launcher.launch_jobs(_launcher(tmp_path / "s3"), [["algo.lr=1e-3"], ["algo.lr=3e-3"]], 0)
    assert len(no_ray_launch) == 1


def test_a_job_config_that_resolves_only_on_its_worker_is_left_to_the_job(
    tmp_path: Path, no_ray_launch: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An interpolation of the driver's environment (`${oc.env:...}` set on the workers only) is no proof the job's
    config is wrong: the jobs start (with a warning), and each checks its config when it runs. A `${hydra:...}` one
    resolves against the job's own Hydra config, as in the job: no warning."""
    from roll_core import sweep_launcher

    monkeypatch.delenv("ROLL_TEST_UNSET_NAME", raising=False)
    with pytest.raises(RuntimeError, match="launched"):
        sweep_launcher.launch_jobs(_launcher(tmp_path / "a"), [["tracking.run_name=run-${hydra:job.num}"]], 0)
    assert "cannot be resolved" not in caplog.text
    with pytest.raises(RuntimeError, match="launched"):
        sweep_launcher.launch_jobs(_launcher(tmp_path / "b"), [["tracking.run_name=${oc.env:ROLL_TEST_UNSET_NAME}"]], 0)
    assert "sweep job 0: its config cannot be resolved before it starts" in caplog.text
    assert len(no_ray_launch) == 2


def test_a_job_task_no_node_can_hold_is_refused_instead_of_waiting_forever(
    tmp_path: Path, no_ray_launch: list[Any]
) -> None:
    """hydra.launcher.ray.remote.num_gpus=1 (cluster=local) on a machine without a GPU, or num_cpus over its cores:
    Ray kept every job's task pending forever and the sweep hung with no error. Refused before any job starts on a
    Ray instance the sweep started, naming what the task asks and what the node has; a warning on a joined cluster
    (an autoscaler may add a node). A task that fits starts."""
    from roll_core import sweep_launcher

    jobs = [["algo.lr=1e-3"]]
    with pytest.raises(ConfigError, match=r"asks for CPU=1, GPU=1 .*its nodes: CPU=2, GPU=0.*forever"):
        sweep_launcher.launch_jobs(_launcher(tmp_path / "a", {"num_cpus": 1, "num_gpus": 1}), jobs, 0)
    with pytest.raises(ConfigError, match=r"asks for CPU=4 \("):
        sweep_launcher.launch_jobs(_launcher(tmp_path / "b", {"num_cpus": 4}), jobs, 0)
    with pytest.raises(ConfigError, match=r"asks for CPU=1, GPU=1 "):  # Ray's default: a task takes a CPU
        sweep_launcher.launch_jobs(_launcher(tmp_path / "b2", {"num_gpus": 1}), jobs, 0)
    assert no_ray_launch == []

    with pytest.raises(RuntimeError, match="launched"):  # a joined cluster: it may grow
        sweep_launcher.launch_jobs(_launcher(tmp_path / "c", {"num_gpus": 1}, {"address": "auto"}), jobs, 0)
    with pytest.raises(RuntimeError, match="launched"):  # fits the node
        sweep_launcher.launch_jobs(_launcher(tmp_path / "d", {"num_cpus": 2}), jobs, 0)
    assert len(no_ray_launch) == 2


def test_a_resumed_sweep_keeps_job_folders_named_by_their_overrides() -> None:
    """hydra.sweep.subdir=${hydra.job.override_dirname}: a sweep is resumed by adding pipeline.resume=true, which
    Hydra put into every job's folder name, so each job found no checkpoint in its new folder and trained again from
    step 1 beside the run it was to continue. The resume overrides are left out of the folder name; the swept
    values still name it."""
    from roll_core.config.compose import compose

    names = [
        compose(overrides, return_hydra_config=True).hydra.job.override_dirname
        for overrides in (
            ["algo.lr=1e-3", "algo.group_size=4"],
            ["algo.lr=1e-3", "algo.group_size=4", "pipeline.resume=true"],
            ["algo.lr=1e-3", "pipeline.resume_from=/runs/x", "algo.group_size=4"],
        )
    ]
    assert names == ["algo.group_size=4,algo.lr=1e-3"] * 3
