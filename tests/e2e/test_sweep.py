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


def test_sweep_of_three_jobs_on_ray_writes_summary(seven_task: Path, tmp_path: Path) -> None:
    proc = sweep(
        tmp_path,
        "experiment=sweep_tiny",
        f"env.path={seven_task}",
        "algo.lr=1e-3,3e-3,1e-2",
        "pipeline.max_steps=4",
        "pipeline.eval_every=2",
        "cluster.max_concurrent=2",
        "hydra/launcher=ray",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sweep: started a local Ray instance on loopback" in proc.stdout + proc.stderr
    table = rows(tmp_path)
    assert [r["status"] for r in table] == ["ok", "ok", "ok"]
    assert sorted(r["params"] for r in table) == ["algo.lr=0.001", "algo.lr=0.003", "algo.lr=0.01"]
    assert all(r["final_eval_accuracy"] not in ("", None) and float(r["wall_seconds"]) > 0 for r in table)
    assert (tmp_path / "sweep" / "summary.md").read_text().count("\n| ") >= 3
    assert (tmp_path / "sweep" / "rewards.png").stat().st_size > 10_000
    # max_concurrent=2 with 3 jobs: the third waited for a slot about as long as a job runs
    queued = sorted(float(r["queued_seconds"]) for r in table)
    run = min(float(r["wall_seconds"]) for r in table)
    assert queued[2] > 0.5 * run and queued[1] < queued[2] - 0.5 * run  # two started at once, one queued


def test_failing_job_does_not_stop_the_others(seven_task: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    proc = sweep(
        tmp_path,
        "experiment=sweep_tiny",
        f"env.path={seven_task},{missing}",
        "pipeline.max_steps=2",
        "cluster=local",
        "cluster.max_concurrent=0",
        "hydra/launcher=ray",
    )
    assert proc.returncode == 1
    assert "1 sweep job(s) failed" in proc.stderr and "missing.jsonl" in proc.stderr
    status = {r["params"].removeprefix("env.path="): r for r in rows(tmp_path)}
    assert status[str(seven_task)]["status"] == "ok"
    assert status[str(missing)]["status"] == "failed" and "ConfigError" in status[str(missing)]["error"]


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
