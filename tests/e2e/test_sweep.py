"""Hydra multirun sweeps of roll-train on a local Ray instance: summary, queueing, failure isolation, Optuna."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="install roll-core[sweep]")
BIN = Path(sys.executable).parent


def sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")  # configs: the packages' and the repository's conf/
    cmd = [str(BIN / "roll-train"), "-m", *overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)


def rows(tmp_path: Path) -> list[dict[str, str]]:
    with open(tmp_path / "sweep" / "summary.csv") as f:
        return list(csv.DictReader(f))


# CI time (~70 s: a sweep of four tiny runs on a Ray instance of its own): the launcher's parts stay in CI below (slots,
# a killed job's slot, an aborted sweep, with the shared Ray instance) and in test_sweep_summary.py / test_sweep_jobs.py
# (records, the summary, killed jobs, Optuna through a local sweep); `nox -s full_matrix` runs this whole sweep on Ray.
@pytest.mark.full_matrix
def test_sweep_on_ray_queues_jobs_writes_summary_and_isolates_a_failing_job(seven_task: Path, tmp_path: Path) -> None:
    """Four jobs, two slots: three train (the same task from three files) and one names a missing file. The failing
    job is recorded and reported, the others finish, each in its own folder though the command names one
    (pipeline.output_dir); one of the three that train waits for a slot about as long as
    a job runs. (One sweep for both: each sweep starts its own Ray instance and its jobs' Ray roles, ~25 s.)"""
    import shutil

    paths = [seven_task, tmp_path / "seven_b.jsonl", tmp_path / "seven_c.jsonl"]
    for copy in paths[1:]:
        shutil.copy(seven_task, copy)
    missing = tmp_path / "missing.jsonl"
    proc = sweep(
        tmp_path,
        "experiment=sweep_tiny",
        "env.path=" + ",".join(str(p) for p in [*paths, missing]),
        "pipeline.max_steps=4",
        "pipeline.eval_every=2",
        "cluster.max_concurrent=2",
        "hydra/launcher=ray",
        f"pipeline.output_dir={tmp_path / 'one_folder'}",  # ignored in a multirun: every job keeps its own folder
    )
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert not (tmp_path / "one_folder").exists()
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in (tmp_path / "sweep").glob("*/*.log"))
    assert "is ignored in a multirun: job 0 writes to its own folder" in logs
    assert "sweep: started a local Ray instance on loopback" in proc.stdout + proc.stderr
    assert "1 sweep job(s) failed" in proc.stderr and "missing.jsonl" in proc.stderr
    table = {r["params"].removeprefix("env.path="): r for r in rows(tmp_path)}
    assert sorted(table) == sorted(str(p) for p in [*paths, missing])
    failed = table.pop(str(missing))
    assert failed["status"] == "failed" and "ConfigError" in failed["error"]
    ok = list(table.values())
    assert [r["status"] for r in ok] == ["ok", "ok", "ok"]
    assert all(r["final_eval_accuracy"] not in ("", None) and float(r["wall_seconds"]) > 0 for r in ok)
    assert (tmp_path / "sweep" / "summary.md").read_text().count("\n| ") >= 4
    assert (tmp_path / "sweep" / "rewards.png").stat().st_size > 10_000
    # max_concurrent=2 with three jobs that train: one waited for a slot about as long as a job runs (the failing
    # job holds a slot for a moment only, whenever it gets one)
    queued = sorted(float(r["queued_seconds"]) for r in ok)
    run = min(float(r["wall_seconds"]) for r in ok)
    assert queued[2] > 0.5 * run and queued[1] < queued[2] - 0.5 * run  # two started at once, one queued


# CI time (~35 s: a second sweep on Ray): roll's launcher's `killed` path is tested with Ray's own error in
# test_sweep_summary.py; `nox -s full_matrix` runs this real SIGKILL.
@pytest.mark.full_matrix
def test_a_job_killed_outright_is_summarised_and_the_sweep_goes_on(seven_task: Path, tmp_path: Path) -> None:
    """SIGKILL one job's process once it trains (what the OOM killer does): nothing in it can catch that, yet the
    sweep waits for the other job, summarises both (the killed one as `killed`, with its curve and wall time so
    far) and exits 1. (hydra-ray-launcher raised out of the sweep at the first dead job: no summary, the other jobs
    abandoned.)"""
    import json
    import signal
    import time

    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    sweep_dir = tmp_path / "sweep"
    cmd = [
        str(BIN / "roll-train"),
        "-m",
        "experiment=sweep_tiny",
        f"env.path={seven_task}",
        "algo.lr=1e-3,3e-3",
        "pipeline.max_steps=6",
        "cluster.max_concurrent=2",
        "hydra/launcher=ray",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        status, metrics = sweep_dir / "1" / "job_status.json", sweep_dir / "1" / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # job 1 has trained a step
            assert proc.poll() is None and time.monotonic() < deadline, "job 1 never trained"
            time.sleep(0.5)
        os.kill(json.loads(status.read_text())["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-4000:]
    assert "1 sweep job(s) failed: algo.lr=0.003" in err, err[-4000:]
    table = {r["job"]: r for r in rows(tmp_path)}
    assert table["0"]["status"] == "ok" and table["0"]["final_eval_accuracy"] not in ("", None)
    assert table["1"]["status"] == "killed" and "Error" in table["1"]["error"], table["1"]
    assert table["1"]["final_reward"] not in ("", None)  # its curve up to the kill
    # its wall time runs from its start to its death, seen when it happens (not after job 0, launched first, ended;
    # it was 0.0)
    assert 0 < float(table["1"]["wall_seconds"]) < float(table["0"]["wall_seconds"]), table
    assert (sweep_dir / "rewards.png").stat().st_size > 10_000


@pytest.mark.full_matrix  # CI time: the Ray launcher runs in the sweeps above; `nox -s full_matrix` runs this
def test_optuna_sweeper_with_ray_launcher(seven_task: Path, tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    proc = sweep(
        tmp_path,
        "experiment=sweep_tiny",
        f"env.path={seven_task}",
        "hydra/sweeper=optuna",
        "hydra/launcher=ray",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.direction=maximize",
        "algo.lr=interval(1e-3,1e-2)",
        "pipeline.max_steps=2",
        "pipeline.eval_every=2",
        "cluster.max_concurrent=2",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "sweep" / "optimization_results.yaml").exists()
    assert len(rows(tmp_path)) == 2


def test_a_killed_job_gives_its_slot_back(ray_cluster) -> None:
    """A job killed while it holds a sweep slot (os._exit: no finally runs) stops renewing its lease; the slot
    returns after lease_s, so the jobs queued behind it run instead of waiting forever."""
    import ray

    from roll_core.sweep import SLOTS_NAMESPACE, job_slot

    name = f"slots-test-{os.getpid()}"

    @ray.remote(num_cpus=0, max_retries=0)
    def job_that_dies() -> None:
        with job_slot(name, permits=1, poll_s=0.05, lease_s=2.0):
            os._exit(1)  # SIGKILL-like: no release, no finally

    with pytest.raises(ray.exceptions.RayError):
        ray.get(job_that_dies.remote())
    actor = ray.get_actor(name, namespace=SLOTS_NAMESPACE)
    try:
        assert ray.get(actor.stats.remote())["held"] == 1  # the dead job still holds the slot ...
        with job_slot(name, permits=1, poll_s=0.05, lease_s=2.0, timeout_s=20) as waited:
            assert waited > 0  # ... until its lease lapsed
        assert ray.get(actor.stats.remote()) == {"held": 0, "permits": 1, "expired": 1}
    finally:
        ray.kill(actor)


def test_a_live_job_whose_lease_lapsed_keeps_its_slot_until_it_dies(ray_cluster) -> None:
    """A job that stopped renewing its lease (a long GC pause, a loaded machine) but still ran lost its slot to the
    next job: max_concurrent + 1 jobs at once. The slots actor now asks Ray whether the holder's process lives (an
    object it put): the slot stays its own while it does, and is reclaimed once it died."""
    import time

    import ray

    from roll_core.sweep_slots import SLOTS_NAMESPACE, JobSlots

    name = f"slots-live-{os.getpid()}"
    slots = ray.remote(JobSlots).options(name=name, namespace=SLOTS_NAMESPACE, num_cpus=0).remote(1, 1.0)

    @ray.remote(num_cpus=0, max_restarts=0)
    class Job:  # takes the slot and never renews it: paused, as far as the actor can tell
        def take(self) -> bool:
            self.owner = [ray.put("paused")]
            return ray.get(slots.try_acquire.remote("paused", self.owner))

    job = Job.remote()
    try:
        assert ray.get(job.take.remote())
        time.sleep(1.5)  # its lease lapsed
        assert not ray.get(slots.try_acquire.remote("next", [ray.put("next")]))
        assert ray.get(slots.stats.remote()) == {"held": 1, "permits": 1, "expired": 0}
        ray.kill(job)
        deadline = time.monotonic() + 30
        while not ray.get(slots.try_acquire.remote("next", [ray.put("next")])):
            assert time.monotonic() < deadline, ray.get(slots.stats.remote())
            time.sleep(0.2)
        assert ray.get(slots.stats.remote()) == {"held": 1, "permits": 1, "expired": 1}
    finally:
        ray.kill(job)
        ray.kill(slots)


def _slots_actors(ray) -> dict[str, dict[str, int]]:
    """Every sweep slots actor in the cluster (whatever its name), with its stats."""
    from roll_core.sweep import SLOTS_NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == SLOTS_NAMESPACE]
    return {n: ray.get(ray.get_actor(n, namespace=SLOTS_NAMESPACE).stats.remote()) for n in names}


def _kill_slots_actors(ray) -> None:
    from roll_core.sweep import SLOTS_NAMESPACE

    for name in _slots_actors(ray):
        ray.kill(ray.get_actor(name, namespace=SLOTS_NAMESPACE))


def _sweep_job(sweep_dir: Path, num: int, max_concurrent: int, run) -> float:
    """roll_core.sweep.run_sweep_job as Hydra calls it in job `num` of a sweep into `sweep_dir` (HydraConfig faked)."""
    from unittest import mock

    from omegaconf import OmegaConf

    from roll_core import sweep

    hc = {
        "runtime": {"output_dir": str(sweep_dir / str(num)), "cwd": str(sweep_dir.parent)},
        "sweep": {"dir": str(sweep_dir)},
        "job": {"num": num},
        "overrides": {"task": [f"algo.lr={num}"]},
    }
    tracking = {"group": None, "run_name": None}
    cfg = OmegaConf.create({"experiment": "t", "cluster": {"max_concurrent": max_concurrent}, "tracking": tracking})
    with mock.patch("hydra.core.hydra_config.HydraConfig.get", return_value=OmegaConf.create(hc)):
        return sweep.run_sweep_job(cfg, run)


def test_a_sweep_run_again_into_its_folder_gets_its_own_slots(ray_cluster, tmp_path: Path, monkeypatch) -> None:
    """A sweep aborted (Ctrl-C) skips on_multirun_end and leaves its detached slots actor (its permits, its dead
    jobs' leases) in a Ray cluster that outlives it (hydra.launcher.ray.init.address=auto). A sweep run again into
    the same folder with cluster.max_concurrent=2 found that actor and ran with its 1 permit; it gets its own."""
    import ray
    from omegaconf import OmegaConf

    from roll_core import sweep

    monkeypatch.setattr(sweep, "_failed_jobs", [])
    monkeypatch.setattr(sweep, "_sweeps", {})
    sw = tmp_path / "sweep"
    hydra_cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(sw)}, "launcher": {"_target_": "basic"}}})
    held: list[dict[str, int]] = []

    def run(cfg) -> dict[str, float]:  # the slots the job holds while it trains
        held.extend(stats for stats in _slots_actors(ray).values() if stats["held"])
        return {"final_eval_accuracy": 0.5}

    callback = sweep.SweepSummaryCallback()
    try:
        callback.on_multirun_start(hydra_cfg)
        assert _sweep_job(sw, 0, 1, run) == 0.5  # ... then the sweep is aborted: no on_multirun_end
        assert held == [{"held": 1, "permits": 1, "expired": 0}]
        held.clear()
        callback.on_multirun_start(hydra_cfg)
        assert _sweep_job(sw, 0, 2, run) == 0.5
        assert held == [{"held": 1, "permits": 2, "expired": 0}]
        callback.on_multirun_end(hydra_cfg)
        assert sweep.failed_jobs() == []
    finally:
        _kill_slots_actors(ray)


def test_an_aborted_sweep_removes_its_slots_actor(ray_cluster, tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C while a sweep's jobs hold their slots: roll's Ray launcher removes the sweep's detached slots actor
    (Hydra skips on_multirun_end, which removes it otherwise), so it is not left behind in a Ray cluster that
    outlives the sweep. It stayed there until the cluster stopped."""
    import time
    from types import SimpleNamespace

    import ray
    from omegaconf import OmegaConf

    from roll_core import sweep, sweep_launcher

    monkeypatch.setattr(sweep, "_sweeps", {})
    sw = tmp_path / "sweep"
    sweep.start_sweep(sw)  # what on_multirun_start does

    here = sys.modules[__name__]  # a Ray task calls _sweep_job: sent by value, Ray's workers cannot import this module
    ray.cloudpickle.register_pickle_by_value(here)

    @ray.remote(num_cpus=0, max_retries=0)
    def job(sweep_dir: str, num: int) -> float:  # a job that trains for long in its slot
        return _sweep_job(Path(sweep_dir), num, 1, lambda cfg: time.sleep(300) or {})

    refs = []
    base = {"hydra": {"sweep": {"dir": str(sw)}, "hydra_logging": {}, "verbose": False, "job": {}}}
    loader = SimpleNamespace(load_sweep_config=lambda config, overrides: OmegaConf.create(base))
    launcher = SimpleNamespace(
        config=OmegaConf.create(base),
        hydra_context=SimpleNamespace(config_loader=loader),
        task_function=lambda cfg: None,  # launch() below runs the job instead
        ray_cfg=OmegaConf.create({"init": {}, "remote": {}}),
    )

    def launch(context, remote, cfg, task, state):
        refs.append(job.remote(str(sw), int(cfg.hydra.job.num)))
        return refs[-1]

    def interrupted_wait(*args, **kwargs):  # Ctrl-C once a job holds its slot
        deadline = time.monotonic() + 60
        while not any(s["held"] for s in _slots_actors(ray).values()):
            assert time.monotonic() < deadline, "the job never took its slot"
            time.sleep(0.2)
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_launcher, "launch_job_on_ray", launch)
    monkeypatch.setattr(sweep_launcher, "configure_log", lambda *args: None)
    monkeypatch.setattr(ray, "wait", interrupted_wait)
    try:
        with pytest.raises(KeyboardInterrupt):
            sweep_launcher.launch_jobs(launcher, [["algo.lr=1"]], 0)
        deadline = time.monotonic() + 60  # Ray ends actors in seconds; a loaded machine takes longer
        while _slots_actors(ray) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _slots_actors(ray) == {}
    finally:
        ray.cloudpickle.unregister_pickle_by_value(here)
        for ref in refs:
            ray.cancel(ref, force=True)
        _kill_slots_actors(ray)


_RAY_APP = """
import time
import hydra
from roll_core.pipelines.run_control import GracefulStop
from roll_core.sweep import run_sweep_job


def run(cfg):  # trains until asked to stop, then stops at a checkpoint (as roll_core.pipelines.loop does)
    with GracefulStop() as stop:
        deadline = time.monotonic() + 120
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.1)
    return {"final_eval_accuracy": 0.5, "stopped_by_signal": stop.signum}


@hydra.main(version_base=None, config_path=".", config_name="app")
def main(cfg):
    return run_sweep_job(cfg, run)


if __name__ == "__main__":
    main()
"""


# CI time (~15 s, most of it the Ray instance the sweep starts): the only test of a signal to the Ray launcher's driver
def test_a_ray_sweep_stopped_by_a_signal_to_its_driver_is_summarised(tmp_path: Path) -> None:
    """SIGTERM to a sweep's driver on roll's Ray launcher (a scheduler's stop) while job 0 runs and job 1 waits for
    its slot: Ray's driver handler exited 15 at once, the jobs abandoned, their records `running`, no summary. Now
    the running job is asked to stop (it stops at its checkpoint: `stopped`), the waiting one is `stopped` (not
    started), the summary is written and the driver exits 128+15. Jobs are run_sweep_job over a run that waits
    for its stop (no training: ~20 s, most of it Ray's start)."""
    import json
    import signal
    import time

    (tmp_path / "app.py").write_text(_RAY_APP)
    (tmp_path / "app.yaml").write_text(
        "experiment: t\ncluster: {max_concurrent: 1}\ntracking: {group: null, run_name: null}\nx: 1\n"
        "defaults:\n  - override hydra/launcher: ray\n  - _self_\n"
        "hydra:\n  callbacks:\n    summary: {_target_: roll_core.sweep.SweepSummaryCallback}\n"
        "  launcher:\n    _target_: hydra_plugins.roll_ray_launcher.RayLauncher\n"
        "    ray: {init: {num_cpus: 2, include_dashboard: false}, remote: {num_cpus: 0, max_retries: 0}}\n"
    )
    sw = tmp_path / "sweep"
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "app.py", "-m", "x=1,2", f"hydra.sweep.dir={sw}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        started = [sw / n / "job_status.json" for n in ("0", "1")]
        while not any(p.exists() and "started_at" in json.loads(p.read_text() or "{}") for p in started):
            assert proc.poll() is None and time.monotonic() < deadline, "no job started"
            time.sleep(0.2)
        time.sleep(1)  # the other job waits for the slot
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    table = {r["job"]: r for r in rows(tmp_path)}
    ran = next(j for j in table if "not started" not in table[j]["error"])
    waited = "1" if ran == "0" else "0"
    assert table[ran]["status"] == "stopped" and table[ran]["error"] == "stopped by signal 2", table
    assert table[waited]["status"] == "stopped" and table[waited]["error"].startswith("not started"), table
    assert (sw / "summary.md").is_file()


def _scored_trial(cfg):
    """An Optuna trial's job on roll's Ray launcher (a Hydra task run in a Ray worker): run_sweep_job over a run
    whose final held-out accuracy is 1 - |x - 0.3|, written to the job's metrics.jsonl as the pipeline writes it."""
    import json

    from hydra.core.hydra_config import HydraConfig

    from roll_core.sweep import run_sweep_job

    def run(cfg):
        accuracy = 1.0 - abs(float(cfg.x) - 0.3)
        line = {"step": 1, "reward/mean": accuracy, "eval/accuracy": accuracy}
        (Path(HydraConfig.get().runtime.output_dir) / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        if cfg.get("stop_driver") and HydraConfig.get().job.num % 2 == 0:  # a scheduler's SIGTERM to the driver
            import os
            import signal
            import time

            from roll_core.pipelines.run_control import GracefulStop

            with GracefulStop() as stop:  # the driver's stop reaches it as a SIGINT (Ray's cancel)
                os.kill(int(cfg.stop_driver), signal.SIGTERM)
                deadline = time.monotonic() + 60
                while not stop.requested and time.monotonic() < deadline:
                    time.sleep(0.05)
            return {"final_eval_accuracy": accuracy, "stopped_by_signal": stop.signum}
        return {"final_eval_accuracy": accuracy, "stopped_by_signal": None}

    return run_sweep_job(cfg, run)


_OPTUNA_RAY_APP = """
experiment: t
cluster: {max_concurrent: 2}
tracking: {group: null, run_name: null}
x: 0.5
defaults:
  - override hydra/launcher: ray
  - override hydra/sweeper: optuna
  - _self_
hydra:
  callbacks:
    summary: {_target_: roll_core.sweep.SweepSummaryCallback}
  launcher:  # roll's (roll-train's hydra/launcher=ray); the running Ray instance is joined
    _target_: hydra_plugins.roll_ray_launcher.RayLauncher
    ray: {remote: {num_cpus: 0, max_retries: 0}}
  sweeper:
    n_trials: 4
    n_jobs: 2
    direction: maximize
    study_name: ray
    sampler: {seed: 0}
    params:
      x: interval(0, 1)
"""


# CI time (~10 s on the shared Ray instance: jobs that write one metrics line, 4 + 2 + 2 of them). Optuna 2.10
# imports SQLAlchemy's declarative_base from its 1.x place: a deprecation warning, an error under pytest.
@pytest.mark.filterwarnings("ignore:.*declarative_base:DeprecationWarning")
def test_an_optuna_sweep_on_the_ray_launcher_tells_optuna_and_the_summary_each_trial(
    ray_cluster, tmp_path: Path, monkeypatch
) -> None:
    """hydra-optuna-sweeper over roll's Ray launcher (jobs in Ray workers, 2 at a time, the shared Ray instance
    joined): each trial's value, computed in its worker, reaches Optuna (a COMPLETE trial with that value, for its
    sampled x), roll's summary (the job `ok`, its final accuracy the same value) and optimization_results.yaml (the
    best of them). A second sweep continuing the study (its SQL storage) into the same folder runs as jobs 4 and 5,
    beside the first sweep's four (they ran as jobs 0 and 1, over the first sweep's). A third, stopped by a SIGTERM
    to the driver, exits 128+15 with the study's best result so far saved."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    import signal

    import hydra
    import optuna
    import ray
    import yaml

    from roll_core import sweep
    from roll_core.testing.sweeps import reset_sweep_state, root_logging_restored, summary_rows

    reset_sweep_state(monkeypatch)
    (tmp_path / "app.yaml").write_text(_OPTUNA_RAY_APP)
    sw, storage = tmp_path / "sweep", f"sqlite:///{tmp_path / 'study.db'}"
    here = sys.modules[__name__]  # the task goes to Ray's workers by value: they cannot import this module
    ray.cloudpickle.register_pickle_by_value(here)
    main = hydra.main(version_base=None, config_path=str(tmp_path), config_name="app")(_scored_trial)

    def run_sweep(n_trials: int, *more: str) -> None:
        args = [f"hydra.sweeper.n_trials={n_trials}", f"hydra.sweeper.storage={storage}", f"hydra.sweep.dir={sw}"]
        monkeypatch.setattr(sys, "argv", ["app", "-m", *args, *more])
        with root_logging_restored():
            main()

    try:
        run_sweep(4)
        study = optuna.load_study(study_name="ray", storage=storage)
        assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
        assert [t.value for t in study.trials] == pytest.approx([1 - abs(t.params["x"] - 0.3) for t in study.trials])
        rows = summary_rows(sw)
        assert [(r["job"], r["status"]) for r in rows] == [(str(i), "ok") for i in range(4)]
        assert [float(r["final_eval_accuracy"]) for r in rows] == pytest.approx([t.value for t in study.trials])
        assert [r["overrides"] for r in rows] == [f"x={t.params['x']}" for t in study.trials]
        best = yaml.safe_load((sw / "optimization_results.yaml").read_text())
        assert best == {"name": "optuna", "best_params": study.best_params, "best_value": study.best_value}
        assert sweep.failed_jobs() == []

        run_sweep(2)  # the study continued, into the same folder
        study = optuna.load_study(study_name="ray", storage=storage)
        assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 6
        assert [(r["job"], r["status"]) for r in summary_rows(sw)] == [("4", "ok"), ("5", "ok")]
        assert sorted(int(p.name) for p in sw.iterdir() if p.is_dir()) == list(range(6))
        assert sweep.failed_jobs() == []

        # A SIGTERM to the driver from job 6 (of 6 and 7): the Ray launcher stops the sweep in the sweeper's call;
        # the best result so far is saved from the study roll kept (the sweeper's own write never comes)
        (sw / "optimization_results.yaml").unlink()
        old = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Ray's own handler: the sweep's takes it, gives it back
        try:
            with pytest.raises(SystemExit) as stopped:
                run_sweep(4, f"+stop_driver={os.getpid()}")
        finally:
            signal.signal(signal.SIGTERM, old)
        assert stopped.value.code == 128 + signal.SIGTERM
        rows = {r["job"]: r["status"] for r in summary_rows(sw)}
        assert rows["6"] == "stopped" and sorted(rows) == ["6", "7"], rows  # no batch after the stop
        study = optuna.load_study(study_name="ray", storage=storage)
        best = yaml.safe_load((sw / "optimization_results.yaml").read_text())
        assert best == {"name": "optuna", "best_params": study.best_params, "best_value": study.best_value}
    finally:
        ray.cloudpickle.unregister_pickle_by_value(here)
        _kill_slots_actors(ray)
