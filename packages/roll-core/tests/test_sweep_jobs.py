"""A sweep's jobs (roll_core.sweep, roll_core.sweep_launcher), with no training: roll's Ray launcher refuses a
sweep whose jobs would clash (a swept cluster.max_concurrent, two jobs in one folder, GPUs reserved twice) before
any job starts, with Ray itself left out; a signal that stops a local job stops the sweep; a failed job is a failed
Optuna trial and the sweep goes on (the real hydra-optuna-sweeper, in a subprocess); a resumed sweep refuses a job
folder of other swept values. Each job is run_sweep_job with a fake `run` (roll_core.testing.sweeps.run_job). The
summary and failure count on hand-made job folders: test_sweep_summary.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import roll_core.sweep as sweep
from roll_core.testing.sweeps import multirun_config, reset_sweep_state, run_job, summary_rows


@pytest.fixture(autouse=True)
def _fresh_sweep_state(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_sweep_state(monkeypatch)  # failed_jobs() and the started sweeps are per process: every test starts from none


def _launcher(sweep_dir: Path, values: dict[str, int]) -> Any:
    """A RayLauncher as Hydra sets it up, whose job configs give `cluster.max_concurrent` by override."""
    from types import SimpleNamespace

    base = {"hydra": {"sweep": {"dir": str(sweep_dir)}, "hydra_logging": {}, "verbose": False, "job": {}}}

    def load_sweep_config(config: Any, overrides: list[str]) -> Any:
        return OmegaConf.create({**base, "cluster": {"max_concurrent": values[overrides[0]]}})

    loader = SimpleNamespace(load_sweep_config=load_sweep_config)
    return SimpleNamespace(
        config=OmegaConf.create(base),
        hydra_context=SimpleNamespace(config_loader=loader),
        task_function=lambda cfg: None,
        ray_cfg=OmegaConf.create({"init": {}, "remote": {}}),
    )


def test_a_sweep_of_max_concurrent_is_refused_before_any_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cluster.max_concurrent=1,2`: the sweep's jobs share one slots actor, created by whichever job came first
    with its own permits, so the other value was silently ignored. The launcher refuses it, naming the setting,
    before any job starts; also when a later batch (an Optuna sweeper's) gives another value than the first."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="install roll-core[sweep]")
    from roll_core import sweep_launcher
    from roll_core.errors import ConfigError

    launched: list[Any] = []

    def launch(context: Any, remote: Any, cfg: Any, task: Any, state: Any) -> None:
        launched.append(cfg)
        raise RuntimeError("launched")  # no Ray here: stop at the first job that would start

    monkeypatch.setattr(sweep_launcher, "launch_job_on_ray", launch)
    monkeypatch.setattr(sweep_launcher, "start_ray", lambda init: None)
    monkeypatch.setattr(sweep_launcher, "configure_log", lambda *args: None)
    launcher = _launcher(tmp_path / "sweep", {"cluster.max_concurrent=1": 1, "cluster.max_concurrent=2": 2})

    with pytest.raises(ConfigError, match=r"cluster.max_concurrent is a setting of the whole sweep.*give 1, 2"):
        sweep_launcher.launch_jobs(launcher, [["cluster.max_concurrent=1"], ["cluster.max_concurrent=2"]], 0)
    assert launched == []

    with pytest.raises(RuntimeError, match="launched"):  # one value: the jobs start
        sweep_launcher.launch_jobs(launcher, [["cluster.max_concurrent=1"]] * 2, 0)
    with pytest.raises(ConfigError, match="give 1, 2"):  # the next batch of the same sweep
        sweep_launcher.launch_jobs(launcher, [["cluster.max_concurrent=2"]], 2)
    assert len(launched) == 1


def _launcher_of(sweep_dir: Path, jobs: dict[str, dict[str, Any]], remote: dict[str, Any] | None = None) -> Any:
    """A RayLauncher as Hydra sets it up; the job of override `o` composes `jobs[o]` (its `subdir`: its
    hydra.sweep.subdir; the rest: its task config)."""
    from types import SimpleNamespace

    base = {"hydra": {"sweep": {"dir": str(sweep_dir)}, "hydra_logging": {}, "verbose": False, "job": {}}}

    def load_sweep_config(config: Any, overrides: list[str]) -> Any:
        job = dict(jobs[overrides[0]])
        subdir = job.pop("subdir", "${hydra.job.num}")
        return OmegaConf.create({"hydra": {**base["hydra"], "sweep": {"dir": str(sweep_dir), "subdir": subdir}}, **job})

    loader = SimpleNamespace(load_sweep_config=load_sweep_config)
    return SimpleNamespace(
        config=OmegaConf.create(base),
        hydra_context=SimpleNamespace(config_loader=loader),
        task_function=lambda cfg: None,
        ray_cfg=OmegaConf.create({"init": {}, "remote": remote or {"num_cpus": 0}}),
    )


@pytest.fixture
def no_ray_launch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """roll's Ray launcher with Ray left out: the job configs it would launch, stopping at the first."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="install roll-core[sweep]")
    from roll_core import sweep_launcher

    launched: list[Any] = []

    def launch(context: Any, remote: Any, cfg: Any, task: Any, state: Any) -> None:
        launched.append(cfg)
        raise RuntimeError("launched")

    monkeypatch.setattr(sweep_launcher, "launch_job_on_ray", launch)
    monkeypatch.setattr(sweep_launcher, "start_ray", lambda init: None)
    monkeypatch.setattr(sweep_launcher, "configure_log", lambda *args: None)
    return launched


def test_jobs_that_would_share_a_folder_are_refused_before_any_starts(tmp_path: Path, no_ray_launch: list[Any]) -> None:
    """hydra.sweep.subdir=${hydra.job.override_dirname} with a repeated value (algo.lr=1e-3,1e-3, an Optuna trial
    sampling a point again) gave two jobs one folder: one metrics.jsonl, and the later job_status.json replaced the
    other job's record. Refused before any job starts, naming both jobs; also against an earlier batch's job."""
    from roll_core import sweep_launcher
    from roll_core.errors import ConfigError

    jobs = {"a": {"subdir": "lr=1e-3"}, "b": {"subdir": "lr=1e-3"}, "c": {"subdir": "lr=3e-3"}}
    launcher = _launcher_of(tmp_path / "sweep", jobs)

    with pytest.raises(ConfigError, match=r"sweep jobs 0 and 1 would write into the same folder .*lr=1e-3"):
        sweep_launcher.launch_jobs(launcher, [["a"], ["b"]], 0)
    assert no_ray_launch == []

    launcher = _launcher_of(tmp_path / "sweep2", jobs)
    with pytest.raises(RuntimeError, match="launched"):  # distinct folders: the jobs start
        sweep_launcher.launch_jobs(launcher, [["a"], ["c"]], 0)
    with pytest.raises(ConfigError, match="sweep jobs 0 and 2 would write"):  # the next batch of that sweep
        sweep_launcher.launch_jobs(launcher, [["b"]], 2)
    assert len(no_ray_launch) == 1


def test_gpus_reserved_for_a_job_task_are_refused_when_its_roles_reserve_their_own(
    tmp_path: Path, no_ray_launch: list[Any]
) -> None:
    """hydra.launcher.ray.remote.num_gpus=1 with cluster=ray: the job's Ray task held a GPU it never used while its
    roles' placement groups waited for free GPUs (on a 1-GPU machine, until cluster.placement_timeout_s failed every
    job). Refused before any job starts; with cluster=local (the roles run in the task) it is how each job gets its
    own GPU, and the jobs start."""
    from roll_core import sweep_launcher
    from roll_core.errors import ConfigError

    jobs = {"ray": {"cluster": {"backend": "ray"}}, "local": {"cluster": {"backend": "local"}}}
    launcher = _launcher_of(tmp_path / "sweep", jobs, remote={"num_cpus": 0, "num_gpus": 1})
    with pytest.raises(ConfigError, match=r"remote.num_gpus=1 .* cluster=ray .* cluster.max_concurrent"):
        sweep_launcher.launch_jobs(launcher, [["ray"], ["ray"]], 0)
    assert no_ray_launch == []

    with pytest.raises(RuntimeError, match="launched"):
        sweep_launcher.launch_jobs(_launcher_of(tmp_path / "s2", jobs, {"num_gpus": 1}), [["local"]], 0)
    with pytest.raises(RuntimeError, match="launched"):  # no GPUs for the task: cluster=ray is fine
        sweep_launcher.launch_jobs(_launcher_of(tmp_path / "s3", jobs), [["ray"]], 0)
    assert len(no_ray_launch) == 2


@pytest.mark.parametrize("second_signal", [False, True], ids=["stopped", "aborted"])
def test_a_ray_sweep_stopped_by_a_signal_reports_what_its_jobs_did(
    second_signal: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_ray_launch: list[Any]
) -> None:
    """roll's Ray launcher stopped by SIGTERM to its driver (the handler marks the sweep while the driver waits)
    after job 0 failed and job 1 finished, with job 2 running and job 3 waiting for its slot; `second_signal`: a
    second SIGTERM aborts the wait. It ended with a bare SystemExit(143): roll-train said nothing of the failed job.
    Now it raises SweepStopped (exit 143) with the line roll-train prints: the counts, the failed job and its error,
    summary.md. Ray is faked: jobs 0 and 1 run here (run_sweep_job), 2 and 3 end cancelled."""
    import time

    import ray

    from roll_core import sweep_launcher

    sw = tmp_path / "sweep"
    sweep_id = sweep.start_sweep(sw)["sweep_id"]  # what on_multirun_start does
    jobs = {f"algo.lr={n}e-3": {} for n in range(1, 5)}
    values: dict[int, Any] = {}

    def fails(cfg: Any) -> Any:
        raise RuntimeError("no data")

    def launch(context: Any, remote: Any, cfg: Any, task: Any, state: Any) -> int:
        num = int(cfg.hydra.job.num)
        overrides = [f"algo.lr={num + 1}e-3"]
        if num == 0:
            values[num] = run_job(sw, "0", 0, overrides, fails)
        elif num == 1:
            values[num] = run_job(sw, "1", 1, overrides, lambda c: {"final_eval_accuracy": 0.5})
        elif num == 2:  # its start record: it trains
            record = {"job": 2, "overrides": overrides, "status": "running", "started_at": time.time()}
            sweep.write_record(sw / "2", {**record, "sweep_id": sweep_id})
        return num  # its "ref"

    cancelled: list[int] = []
    waits: list[int] = []

    def wait(refs: list[int], num_returns: int, timeout: float) -> tuple[list[int], list[int]]:
        waits.append(len(refs))
        if len(waits) == 1:  # SIGTERM while the driver waits: the handler marks the sweep stopped
            sweep.stop_sweep(sw, 15, "the sweep was stopped by signal 15")
            return [r for r in refs if r in values], [r for r in refs if r not in values]
        if second_signal:
            raise SystemExit(128 + 15)  # what the handler raises for a second signal
        return [r for r in refs if r in cancelled], [r for r in refs if r not in cancelled]

    def get(ref: int) -> Any:
        if ref in values:
            return values[ref]
        raise ray.exceptions.TaskCancelledError()

    monkeypatch.setattr(sweep_launcher, "launch_job_on_ray", launch)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "cancel", lambda ref, force=False: cancelled.append(ref))
    with pytest.raises(SystemExit) as stopped:  # sweep_stop.SweepStopped, with the line roll-train prints
        sweep_launcher.launch_jobs(_launcher_of(sw, jobs), [[o] for o in jobs], 0)

    assert stopped.value.code == 128 + 15 and {2, 3} <= set(cancelled)
    rows = summary_rows(sw)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "ok"), ("2", "stopped"), ("3", "stopped")]
    assert getattr(stopped.value, "report", None) == (
        "the sweep was stopped by signal 15 (SIGTERM): 4 job(s): 1 finished, 1 failed, 1 stopped, 1 not started. "
        f"Failed: algo.lr=1e-3 (RuntimeError: no data). Each job's outcome and error: {sw / 'summary.md'}"
    )


@pytest.mark.parametrize("error", ["launch", "interrupt"])
def test_an_error_after_ray_jobs_started_cancels_records_and_summarises_them(
    error: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_ray_launch: list[Any]
) -> None:
    """An error in roll's Ray launcher after some jobs started that is not a stop signal (`launch`: the 4th job's
    launch fails; `interrupt`: a KeyboardInterrupt with no stop mark, roll's signal handlers not installed) removed
    the slots actor and raised, while the started jobs ran on, unbounded, until the driver exited: never
    cancelled, left `running`, no summary. Now each job not yet collected is force-cancelled and recorded (job 0,
    ended ok before the error, keeps its record), the summary is written and the error raised on."""
    import time

    import ray

    from roll_core import sweep_launcher

    sw = tmp_path / "sweep"
    sweep_id = sweep.start_sweep(sw)["sweep_id"]  # what on_multirun_start does
    jobs = {f"algo.lr={n}e-3": {} for n in range(1, 5)}

    def launch(context: Any, remote: Any, cfg: Any, task: Any, state: Any) -> int:
        num = int(cfg.hydra.job.num)
        overrides = [f"algo.lr={num + 1}e-3"]
        if num == 0:  # ended, not yet collected
            run_job(sw, "0", 0, overrides, lambda c: {"final_eval_accuracy": 0.5})
        elif num == 1:  # its start record: it trains
            record = {"job": 1, "overrides": overrides, "status": "running", "started_at": time.time() - 5}
            sweep.write_record(sw / "1", {**record, "sweep_id": sweep_id})
        elif num == 3 and error == "launch":
            raise RuntimeError("no more workers")
        return num  # its "ref"; job 2 waits for its slot (no record)

    def wait(refs: list[int], num_returns: int, timeout: float) -> tuple[list[int], list[int]]:
        raise KeyboardInterrupt()

    cancelled: list[tuple[int, bool]] = []
    monkeypatch.setattr(sweep_launcher, "launch_job_on_ray", launch)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "cancel", lambda ref, force=False: cancelled.append((ref, force)))
    with pytest.raises(RuntimeError if error == "launch" else KeyboardInterrupt):
        sweep_launcher.launch_jobs(_launcher_of(sw, jobs), [[o] for o in jobs], 0)

    started = 3 if error == "launch" else 4
    # An error: asked to stop at a checkpoint first (the fake's wait fails: then killed); an interrupt: killed at once
    gentle = [(n, False) for n in range(started)] if error == "launch" else []
    assert cancelled == gentle + [(n, True) for n in range(started)]
    rows = {r["job"]: r for r in summary_rows(sw)}
    assert sorted(rows) == [str(n) for n in range(started)]
    assert rows["0"]["status"] == "ok"
    if error == "launch":
        assert [(rows[n]["status"], rows[n]["error"]) for n in ("1", "2")] == [
            ("failed", "cancelled while it ran: the sweep raised RuntimeError: no more workers"),
            ("failed", "not started: the sweep raised RuntimeError: no more workers"),
        ]
    else:
        assert [(rows[n]["status"], rows[n]["error"]) for n in ("1", "2", "3")] == [
            ("stopped", "stopped by signal 2: the sweep was stopped while it ran"),
            ("stopped", "stopped by signal 2: not started: the sweep was stopped"),
            ("stopped", "stopped by signal 2: not started: the sweep was stopped"),
        ]
    assert float(rows["1"]["wall_seconds"]) >= 5
    assert len(sweep.failed_jobs()) == started - 1


def test_a_launcher_error_stops_jobs_at_a_checkpoint_and_records_them_once_they_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_ray_launch: list[Any]
) -> None:
    """After an error in roll's Ray launcher (here the 3rd job's launch fails) the running jobs were force-killed at
    once: every step since their last checkpoint lost, where a stop signal lets them save one. And each was recorded
    `failed` right after `ray.cancel`, which returns before the process is gone: a job finishing meanwhile wrote its
    own `ok` record after the launcher's, and its folder said ok where the summary said failed. Now the jobs are asked
    to stop gently first (job 0 saves a checkpoint and ends `stopped`), the rest are killed, and each kill is waited
    for before recording (job 1 finished as it was killed: `ok` in its folder and in the summary)."""
    import threading
    import time

    import ray

    from roll_core import sweep_launcher

    monkeypatch.setattr(sweep_launcher, "ERROR_GRACE_S", 1.0)
    monkeypatch.setattr(sweep_launcher, "KILL_WAIT_S", 5.0)
    sw = tmp_path / "sweep"
    sweep_id = sweep.start_sweep(sw)["sweep_id"]  # what on_multirun_start does
    jobs = {f"algo.lr={n}e-3": {} for n in range(1, 4)}
    ended: set[int] = set()
    timers: list[threading.Thread] = []

    def record(num: int, status: str) -> None:
        overrides = [f"algo.lr={num + 1}e-3"]
        rec = {"job": num, "overrides": overrides, "status": status, "started_at": time.time() - 5}
        sweep.write_record(sw / str(num), {**rec, "sweep_id": sweep_id, "wall_seconds": 5.0})

    def launch(context: Any, remote: Any, cfg: Any, task: Any, state: Any) -> int:
        num = int(cfg.hydra.job.num)
        if num == 2:
            raise RuntimeError("no more workers")
        record(num, "running")
        return num

    def later(num: int, status: str) -> None:
        def run() -> None:
            time.sleep(0.3)  # the job's process is still going when ray.cancel returns
            record(num, status)
            ended.add(num)

        timers.append(threading.Thread(target=run))
        timers[-1].start()

    def cancel(ref: int, force: bool = False) -> None:
        if ref == 0 and not force:  # its GracefulStop: a checkpoint, then its own `stopped` record
            later(0, "stopped")
        elif ref == 1 and force:  # it was writing its `ok` record as it was killed
            later(1, "ok")

    def wait(refs: list[int], num_returns: int, timeout: float) -> tuple[list[int], list[int]]:
        deadline = time.monotonic() + timeout
        while not set(refs) <= ended and time.monotonic() < deadline:
            time.sleep(0.02)
        return [r for r in refs if r in ended], [r for r in refs if r not in ended]

    monkeypatch.setattr(sweep_launcher, "launch_job_on_ray", launch)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "cancel", cancel)
    with pytest.raises(RuntimeError, match="no more workers"):
        sweep_launcher.launch_jobs(_launcher_of(sw, jobs), [[o] for o in jobs], 0)
    for t in timers:
        t.join()

    rows = {r["job"]: r["status"] for r in summary_rows(sw)}
    folders = {n: json.loads((sw / n / sweep.STATUS_FILE).read_text())["status"] for n in ("0", "1")}
    assert rows == folders == {"0": "stopped", "1": "ok"}


def test_a_ray_sweep_stopped_between_batches_launches_no_more_jobs(tmp_path: Path, no_ray_launch: list[Any]) -> None:
    """A signal between two batches (an Optuna sweeper asking its next trials, a grid sweep in batches) only marks
    the sweep stopped; roll's Ray launcher then launched the next batch anyway and cancelled it half a second later:
    jobs started after the stop (a pipeline built, GPUs taken, a race to finish). Now it launches none: they are
    recorded `stopped` ("not started"), the sweep is summarised and ends with SweepStopped (exit 128 + N)."""
    from roll_core import sweep_launcher

    sw = tmp_path / "sweep"
    sweep.start_sweep(sw)  # what on_multirun_start does
    assert run_job(sw, "0", 0, ["algo.lr=1e-3"], lambda cfg: {"final_eval_accuracy": 0.5}) == 0.5  # batch 1
    sweep.stop_sweep(sw, 15, "the sweep was stopped by signal 15")  # SIGTERM while the sweeper asks batch 2
    jobs = {f"algo.lr={n}e-3": {} for n in (2, 3)}

    with pytest.raises(SystemExit) as stopped:
        sweep_launcher.launch_jobs(_launcher_of(sw, jobs), [[o] for o in jobs], 1)

    assert no_ray_launch == []
    assert stopped.value.code == 128 + 15
    assert [(r["job"], r["status"]) for r in summary_rows(sw)] == [("0", "ok"), ("1", "stopped"), ("2", "stopped")]
    assert "3 job(s): 1 finished, 0 failed, 0 stopped, 2 not started" in getattr(stopped.value, "report", "")


def test_a_signal_that_stops_a_local_sweep_job_stops_the_sweep(tmp_path: Path) -> None:
    """Ctrl-C (or a scheduler's SIGTERM) in a local multirun stops the running job at a checkpoint; the sweep's later
    jobs are then not started but recorded as stopped, so the sweep ends, is summarised and exits 128+N, as a single
    run stopped by N (it exited 1, as a sweep with a failed job). The next job started instead: one Ctrl-C per job to
    stop a sweep. A new sweep into the folder runs again."""
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(multirun_config(sw))
    ran: list[int] = []

    def run(num: int, signum: int | None) -> Any:
        def job(cfg: Any) -> dict[str, Any]:
            ran.append(num)
            return {"final_eval_accuracy": 0.5, "stopped_by_signal": signum}

        return job

    assert run_job(sw, "0", 0, ["algo.lr=1e-3"], run(0, None)) == 0.5
    assert run_job(sw, "1", 1, ["algo.lr=2e-3"], run(1, 2)) is None  # Ctrl-C during job 1
    assert run_job(sw, "2", 2, ["algo.lr=3e-3"], run(2, None)) is None
    with pytest.raises(SystemExit) as exit_:
        callback.on_multirun_end(multirun_config(sw))

    assert exit_.value.code == 128 + 2

    assert ran == [0, 1]
    record = json.loads((sw / "2" / sweep.STATUS_FILE).read_text())
    assert record["status"] == "stopped"
    assert record["error"] == "not started: the sweep was stopped by signal 2 during job 1"
    rows = summary_rows(sw)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "stopped"), ("2", "stopped")]
    assert rows[2]["wall_seconds"] == ""  # it never ran: no wall time, not a fake 0
    assert sweep.failed_jobs() == ["algo.lr=2e-3", "algo.lr=3e-3"]

    callback.on_multirun_start(multirun_config(sw))  # run again: its jobs start
    assert run_job(sw, "0", 0, ["algo.lr=3e-3"], run(3, None)) == 0.5
    assert ran == [0, 1, 3]


def test_a_signal_in_a_local_sweep_jobs_last_step_completes_the_job_and_stops_the_sweep(tmp_path: Path) -> None:
    """A Ctrl-C in a job's last step completes that job (summary `late_signal`, not `stopped_by_signal`:
    roll_core.pipelines.loop): it is `ok`, and the signal, meant for the sweep, still stops the later jobs."""
    sw = tmp_path / "sweep"
    sweep.SweepSummaryCallback().on_multirun_start(multirun_config(sw))
    ran: list[int] = []

    def job(num: int, late: int | None) -> Any:
        def run(cfg: Any) -> dict[str, Any]:
            ran.append(num)
            return {"final_eval_accuracy": 0.5, "stopped_by_signal": None, "late_signal": late}

        return run

    assert run_job(sw, "0", 0, ["algo.lr=1e-3"], job(0, 2)) == 0.5
    assert run_job(sw, "1", 1, ["algo.lr=2e-3"], job(1, None)) is None
    assert ran == [0] and json.loads((sw / "0" / sweep.STATUS_FILE).read_text())["status"] == "ok"
    record = json.loads((sw / "1" / sweep.STATUS_FILE).read_text())
    assert record["error"] == "not started: the sweep was stopped by signal 2 at the end of job 0"


_OPTUNA_APP = """
import sys
import hydra
from hydra.core.hydra_config import HydraConfig
from roll_core.sweep import run_sweep_job


def run(cfg):
    if HydraConfig.get().job.num == 0:
        raise RuntimeError("job 0 fails")
    return {"final_eval_accuracy": float(cfg.x)}


@hydra.main(version_base=None, config_path=".", config_name="app")
def main(cfg):
    return run_sweep_job(cfg, run)


if __name__ == "__main__":
    main()
"""


def test_a_failed_job_is_a_failed_trial_and_the_optuna_sweep_goes_on(tmp_path: Path) -> None:
    """The real Optuna sweeper (hydra-optuna-sweeper) over jobs run by run_sweep_job, one of which fails: it was
    given NaN, Optuna's tell refused it, and the sweeper's own FAIL tell raised: the sweep ended at that batch with a
    traceback, no later trial and no summary. Now the failed job is a failed trial and the sweep finishes."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="install roll-core[sweep]")
    import os
    import subprocess
    import sys

    (tmp_path / "app.py").write_text(_OPTUNA_APP)
    (tmp_path / "app.yaml").write_text(
        "x: 0.5\nexperiment: t\ncluster: {max_concurrent: 0}\ntracking: {group: null, run_name: null}\n"
        "hydra:\n  callbacks:\n    summary: {_target_: roll_core.sweep.SweepSummaryCallback}\n"
    )
    sw = tmp_path / "sweep"
    args = [
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.sampler.seed=0",
        "x=interval(0.1,0.9)",
        f"hydra.sweep.dir={sw}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Failed experiment" in proc.stderr + proc.stdout
    results = OmegaConf.load(sw / "optimization_results.yaml")
    assert 0.1 <= results.best_value <= 0.9
    assert [(r["job"], r["status"]) for r in summary_rows(sw)] == [("0", "failed"), ("1", "ok"), ("2", "ok")]


def test_a_resumed_sweep_refuses_a_job_folder_of_other_swept_values(tmp_path: Path) -> None:
    """`pipeline.resume=true` into an earlier sweep's folder continues each job folder's run, and folders are named
    by job number: with the values in another order (or an Optuna trial sampling others) job 0 continued the
    earlier job 0's checkpoint with its own learning rate (a resume accepts a changed lr), a silently mixed run.
    Refused, naming both values, and the refusal keeps what the folder holds; the same order resumes, a changed
    shared setting (max_steps) included."""
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    ran: list[str] = []

    def run(cfg: Any) -> dict[str, Any]:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        ran.append(hc.overrides.task[0])
        (Path(hc.runtime.output_dir) / "checkpoints" / "step_5").mkdir(parents=True, exist_ok=True)
        return {"final_eval_accuracy": 0.5}

    def sweep_of(lrs: list[str], *shared: str) -> list[float | None]:
        callback.on_multirun_start(multirun_config(sw))
        resume = {"pipeline": {"resume": True}} if "pipeline.resume=true" in shared else {}
        return [run_job(sw, str(n), n, [f"algo.lr={lr}", *shared], run, **resume) for n, lr in enumerate(lrs)]

    assert sweep_of(["1e-3", "3e-3"], "pipeline.max_steps=10") == [0.5, 0.5]
    for _ in range(2):  # refused twice: a refused job's record still says what its folder holds
        assert sweep_of(["3e-3", "1e-3"], "pipeline.max_steps=20", "pipeline.resume=true") == [None, None]
    assert ran == ["algo.lr=1e-3", "algo.lr=3e-3"]
    record = json.loads((sw / "0" / sweep.STATUS_FILE).read_text())
    assert record["status"] == "failed"
    assert "holds the run of job 0 of an earlier sweep, with algo.lr=1e-3; this job has algo.lr=3e-3" in record["error"]

    assert sweep_of(["1e-3", "3e-3"], "pipeline.max_steps=20", "pipeline.resume=true") == [0.5, 0.5]
    assert ran[2:] == ["algo.lr=1e-3", "algo.lr=3e-3"]
    assert sweep_of(["3e-3", "1e-3"], "pipeline.max_steps=20") == [0.5, 0.5]  # no resume: the run refuses (not here)
    assert sweep_of(["1e-3", "3e-3"], "pipeline.resume=true") == [0.5, 0.5]  # the folders still say what they hold
    assert sweep_of(["3e-3", "1e-3"], "pipeline.resume=true") == [None, None]


def test_a_resumed_sweep_of_one_job_refuses_a_changed_setting(tmp_path: Path) -> None:
    """The swept settings were told from the folder's earlier records alone: after a sweep of one job every override
    looked shared, so a resume with another learning rate (or one left out, back to the default) continued the
    folder's run silently. Refused, naming the setting with its old and new value, however many jobs the earlier
    sweep had; the run's length (pipeline.max_steps) may still change."""
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    ran: list[list[str]] = []

    def run(cfg: Any) -> dict[str, Any]:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        ran.append(list(hc.overrides.task))
        (Path(hc.runtime.output_dir) / "checkpoints" / "step_5").mkdir(parents=True, exist_ok=True)
        return {"final_eval_accuracy": 0.5}

    def job(*overrides: str) -> float | None:
        callback.on_multirun_start(multirun_config(sw))
        resume = {"pipeline": {"resume": True}} if "pipeline.resume=true" in overrides else {}
        return run_job(sw, "0", 0, list(overrides), run, **resume)

    assert job("algo.lr=1e-3", "algo.group_size=8", "pipeline.max_steps=10") == 0.5
    assert job("algo.lr=3e-3", "algo.group_size=8", "pipeline.max_steps=20", "pipeline.resume=true") is None
    error = json.loads((sw / "0" / sweep.STATUS_FILE).read_text())["error"]
    assert error.startswith("ConfigError: pipeline.resume=true:")
    assert "holds the run of job 0 of an earlier sweep, with algo.lr=1e-3; this job has algo.lr=3e-3" in error
    assert job("algo.group_size=8", "pipeline.resume=true") is None  # left out: the default is another value
    error = json.loads((sw / "0" / sweep.STATUS_FILE).read_text())["error"]
    assert "with algo.lr=1e-3; this job has algo.lr=(not given: the config's default)" in error
    assert len(ran) == 1
    # the same settings, a longer run: continued
    assert job("algo.lr=1e-3", "algo.group_size=8", "pipeline.max_steps=20", "pipeline.resume=true") == 0.5
    assert ran[1] == ["algo.lr=1e-3", "algo.group_size=8", "pipeline.max_steps=20", "pipeline.resume=true"]


def test_a_job_that_never_ran_keeps_what_its_resumed_folder_holds(tmp_path: Path) -> None:
    """A resumed sweep's job that never ran in its folder (not started after a stop; cancelled or killed by Ray
    before its start record) wrote a record of its own values over the earlier sweep's, and the folder's
    checkpoints lost the values they were trained with: a later resume with those new values continued job 1's
    algo.lr=3e-3 run with algo.lr=5e-3. Its record now keeps what the folder holds (`folder_overrides`), and
    that later resume is refused."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="install roll-core[sweep]")
    from roll_core import sweep_launcher

    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    ran: list[str] = []

    def run(signum: int | None = None) -> Any:
        def job(cfg: Any) -> dict[str, Any]:
            from hydra.core.hydra_config import HydraConfig

            hc = HydraConfig.get()
            ran.append(hc.overrides.task[0])
            (Path(hc.runtime.output_dir) / "checkpoints" / "step_5").mkdir(parents=True, exist_ok=True)
            return {"final_eval_accuracy": 0.5, "stopped_by_signal": signum}

        return job

    resume = {"pipeline": {"resume": True}}
    callback.on_multirun_start(multirun_config(sw))
    assert [run_job(sw, str(n), n, [f"algo.lr={lr}"], run()) for n, lr in enumerate(["1e-3", "3e-3"])] == [0.5, 0.5]
    callback.on_multirun_end(multirun_config(sw))
    # resumed with job 1's value changed, stopped by Ctrl-C during job 0: job 1 is not started
    callback.on_multirun_start(multirun_config(sw))
    assert run_job(sw, "0", 0, ["algo.lr=1e-3", "pipeline.resume=true"], run(2), **resume) is None
    assert run_job(sw, "1", 1, ["algo.lr=5e-3", "pipeline.resume=true"], run(), **resume) is None
    with pytest.raises(SystemExit):
        callback.on_multirun_end(multirun_config(sw))
    assert json.loads((sw / "1" / sweep.STATUS_FILE).read_text())["folder_overrides"] == ["algo.lr=3e-3"]
    # resumed again with the same values: job 1 would continue algo.lr=3e-3's run with 5e-3
    callback.on_multirun_start(multirun_config(sw))
    assert run_job(sw, "0", 0, ["algo.lr=1e-3", "pipeline.resume=true"], run(), **resume) == 0.5
    assert run_job(sw, "1", 1, ["algo.lr=5e-3", "pipeline.resume=true"], run(), **resume) is None
    assert ran == ["algo.lr=1e-3", "algo.lr=3e-3", "algo.lr=1e-3", "algo.lr=1e-3"]
    assert (
        "with algo.lr=3e-3; this job has algo.lr=5e-3"
        in json.loads((sw / "1" / sweep.STATUS_FILE).read_text())["error"]
    )
    callback.on_multirun_end(multirun_config(sw))

    # roll's Ray launcher: a job of a sweep into the folder cancelled before it wrote a start record
    sweep.start_sweep(sw)
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(sw), "subdir": "${hydra.job.num}"}, "job": {"num": 1}}})
    sweep_launcher.killed(cfg, ["algo.lr=7e-3"], RuntimeError("cancelled"), stopped=15)
    record = json.loads((sw / "1" / sweep.STATUS_FILE).read_text())
    assert (record["overrides"], record["folder_overrides"]) == (["algo.lr=7e-3"], ["algo.lr=3e-3"])
    sweep.end_sweep(sw)


def test_only_a_folder_holding_just_what_hydra_wrote_for_an_unstarted_trial_is_removed(tmp_path: Path) -> None:
    """The folder Hydra made for an Optuna trial asked after a stop (its .hydra configs and job log) is removed, with
    parents it leaves empty (a nested hydra.sweep.subdir) but never the sweep folder; a folder holding anything else
    (an earlier sweep's job record and checkpoints: a resumed sweep's folder) is left whole."""
    from roll_core.sweep_stop import remove_unstarted_folder

    def hydra_folder(path: Path, *more: str) -> Path:
        for name in [".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "cli.log", *more]:
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_text("x")
        return path

    sw = tmp_path / "sweep"
    (sw / "a" / "kept").mkdir(parents=True)
    assert remove_unstarted_folder(hydra_folder(sw / "3"), ".hydra", "cli.log", sw)
    assert remove_unstarted_folder(hydra_folder(sw / "b" / "c" / "4"), ".hydra", "cli.log", sw)
    assert remove_unstarted_folder(hydra_folder(sw / "a" / "5"), ".hydra", "cli.log", sw)
    assert sorted(str(p.relative_to(sw)) for p in sw.rglob("*")) == ["a", "a/kept"]

    earlier = hydra_folder(sw / "2", sweep.STATUS_FILE, "checkpoints/step_1/model.pt")
    before = sorted(str(p.relative_to(earlier)) for p in earlier.rglob("*"))
    assert not remove_unstarted_folder(earlier, ".hydra", "cli.log", sw)
    extra = hydra_folder(sw / "6", ".hydra/notes.txt")  # .hydra holds a file Hydra did not write for the job
    assert not remove_unstarted_folder(extra, ".hydra", "cli.log", sw)
    assert not remove_unstarted_folder(hydra_folder(sw), ".hydra", "cli.log", sw)  # hydra.sweep.subdir=.
    assert sorted(str(p.relative_to(earlier)) for p in earlier.rglob("*")) == before
    assert (extra / ".hydra" / "notes.txt").is_file() and (extra / "cli.log").is_file()
    assert (sw / "cli.log").is_file()
