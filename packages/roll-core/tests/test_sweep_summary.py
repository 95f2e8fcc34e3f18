"""The sweep summary and failure count (roll_core.sweep), on hand-made job folders: no training, no Ray.

Each test builds what a sweep leaves on disk (job_status.json records, metrics.jsonl) or runs the job wrapper
`run_sweep_job` with a fake `run`, then calls `SweepSummaryCallback` the way Hydra does after a multirun, and checks
summary.csv / summary.md / rewards.png and `failed_jobs()` (non-empty: roll-train exits 1). The launcher tests call
roll's Ray launcher (roll_core.sweep_launcher) with Ray itself left out.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from omegaconf import OmegaConf

import roll_core.sweep as sweep


@pytest.fixture(autouse=True)
def _fresh_sweep_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # failed_jobs() and the started sweeps are per process: every test starts from none
    monkeypatch.setattr(sweep, "_failed_jobs", [])
    monkeypatch.setattr(sweep, "_sweeps", {}, raising=False)
    monkeypatch.setattr(sweep, "_stopped", {}, raising=False)
    monkeypatch.setattr(sweep, "_unfinished", set(), raising=False)


def _job(sweep_dir: Path, folder: str, num: int, overrides: list[str], status: str = "ok", **extra: Any) -> Path:
    """A job folder as run_sweep_job leaves it; `metrics`: its metrics.jsonl records."""
    metrics = extra.pop("metrics", None)
    d = sweep_dir / folder
    d.mkdir(parents=True, exist_ok=True)
    (d / sweep.STATUS_FILE).write_text(json.dumps({"job": num, "overrides": overrides, "status": status, **extra}))
    if metrics is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return d


def _hydra_cfg(sweep_dir: Path) -> Any:
    launcher = {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}, "launcher": launcher}})


def _rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


def _run_job(sweep_dir: Path, folder: str, num: int, overrides: list[str], run: Any, **cfg: Any) -> float | None:
    """run_sweep_job as Hydra calls it in job `num` (its HydraConfig faked), with `run` as the training run; `cfg`:
    more of the job's config."""
    hc = OmegaConf.create(
        {
            "runtime": {"output_dir": str(sweep_dir / folder), "cwd": str(sweep_dir.parent)},
            "sweep": {"dir": str(sweep_dir)},
            "job": {"num": num},
            "overrides": {"task": overrides},
        }
    )
    job = {"experiment": "t", "cluster": {"max_concurrent": 0}, "tracking": {"group": None, "run_name": None}}
    with mock.patch("hydra.core.hydra_config.HydraConfig.get", return_value=hc):
        return sweep.run_sweep_job(OmegaConf.create({**job, **cfg}), run)


def _fails(cfg: Any) -> dict[str, Any]:
    raise FileNotFoundError("no data")


def test_nested_job_folders_are_found_and_listed_in_job_order(tmp_path: Path) -> None:
    """hydra.sweep.subdir=${hydra.job.override_dirname} with values holding "/" nests job folders several levels
    deep: their failures are counted (they vanished, and roll-train exited 0), rows follow the job number (10
    after 2, not before), and a sweep whose records are nowhere to be found is a failure, not "0 jobs"."""
    sw = tmp_path / "sweep"
    for num in (0, 1, 2, 10):
        status = "failed" if num in (1, 10) else "ok"
        folder = f"env.path=/data/set_{num}.jsonl,experiment=t"  # nests: sweep/env.path=/data/set_N.jsonl,.../
        _job(sw, folder, num, ["experiment=t", f"env.path=/data/set_{num}.jsonl"], status, wall_seconds=1.0)
    assert not list(sw.glob(f"*/{sweep.STATUS_FILE}"))  # none of them one level deep

    sweep.SweepSummaryCallback().on_multirun_end(_hydra_cfg(sw))

    assert sweep.failed_jobs() == ["env.path=/data/set_1.jsonl", "env.path=/data/set_10.jsonl"]
    assert [(r["job"], r["status"]) for r in _rows(sw)] == [("0", "ok"), ("1", "failed"), ("2", "ok"), ("10", "failed")]

    empty = tmp_path / "lost"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(_hydra_cfg(empty))
    callback.on_multirun_end(_hydra_cfg(empty))
    assert sweep.failed_jobs()[2:] == [f"no {sweep.STATUS_FILE} of this sweep found under {empty}"]


def test_a_half_written_metrics_line_does_not_lose_the_summary(tmp_path: Path) -> None:
    """A killed job's last metrics.jsonl line is often cut mid-record: the line is skipped, the job keeps its curve
    up to there, and the summary is written (it raised JSONDecodeError: no summary.csv at all)."""
    sw = tmp_path / "sweep"
    _job(sw, "0", 0, ["algo.lr=1e-3"], metrics=[{"step": 1, "reward/mean": 0.5}], wall_seconds=10.0)
    d = _job(sw, "1", 1, ["algo.lr=3e-3"], "killed", error="WorkerCrashedError: died", queued_seconds=0.0)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.25}) + '\n{"step": 2, "reward/me')

    rows = sweep.summarize(sw)

    assert [(r["status"], r["final_reward"]) for r in rows] == [("ok", 0.5), ("killed", 0.25)]
    assert (sw / "summary.md").is_file()


def test_failed_jobs_are_counted_even_when_the_summary_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Hydra turns a callback's exception into a warning: whatever breaks while writing the summary, the jobs that
    were not ok still reach failed_jobs() (roll-train exits 1), and the error is logged."""
    sw = tmp_path / "sweep"
    _job(sw, "0", 0, ["algo.lr=1e-3"], wall_seconds=1.0)
    _job(sw, "1", 1, ["algo.lr=3e-3"], "killed", error="WorkerCrashedError: died")

    def broken_plot(*args: Any) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(sweep, "_plot", broken_plot)
    with caplog.at_level(logging.ERROR, logger="roll_core.sweep"):
        sweep.SweepSummaryCallback().on_multirun_end(_hydra_cfg(sw))  # must not raise

    assert sweep.failed_jobs() == ["algo.lr=3e-3"]
    assert "could not write the summary" in caplog.text and "disk full" in caplog.text


def test_a_killed_job_is_summarised_with_its_real_wall_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job killed 10 minutes into training shows about 600 s (it showed 0.0, as if it never ran); one killed before
    it wrote its start record shows "-" (unknown), not 0."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="install roll-core[sweep]")
    from roll_core import sweep_launcher

    sw = tmp_path / "sweep"
    start: dict[str, Any] = {}

    def run(cfg: Any) -> dict[str, Any]:  # what the job's folder holds while it trains: its start record
        start.update(json.loads((sw / "0" / sweep.STATUS_FILE).read_text()))
        return {"final_eval_accuracy": 0.5}

    _run_job(sw, "0", 0, ["algo.lr=3e-3"], run)
    (sw / "0" / sweep.STATUS_FILE).write_text(json.dumps(start))  # the job is SIGKILLed before its end record
    clock = start.get("started_at", 0.0) + 600.0  # the launcher sees its death 10 minutes after the job started
    monkeypatch.setattr(time, "time", lambda: clock)
    job_cfg = {"sweep": {"dir": str(sw), "subdir": "${hydra.job.num}"}, "job": {"name": "x"}}
    for num in (0, 1):  # job 1 is killed before it wrote anything
        cfg = OmegaConf.create({"hydra": {**job_cfg, "job": {"num": num, "name": "x"}}})
        ret = sweep_launcher.killed(cfg, [f"algo.lr={num + 3}e-3"], RuntimeError("The actor died unexpectedly"))
        assert ret.return_value is None

    rows = sweep.summarize(sw)

    assert [(r["status"], r["wall_seconds"]) for r in rows] == [("killed", 600.0), ("killed", None)]
    assert "| killed | - | - | - | - | 600 |" in (sw / "summary.md").read_text()
    assert "| killed | - | - | - | - | - |" in (sw / "summary.md").read_text()


def test_a_job_stopped_by_a_signal_is_a_failed_trial(tmp_path: Path) -> None:
    """SIGTERM stops a job early (checkpoint written, summary["stopped_by_signal"]): it is recorded as stopped,
    the sweeper gets None (not its early accuracy as a finished trial's) and roll-train exits non-zero (a single
    run exits 128+N). A job that finishes returns its final held-out accuracy as before."""
    sw = tmp_path / "sweep"
    stopped = {"final_eval_accuracy": 0.05, "stopped_by_signal": 15, "wall_seconds": 12.0}
    finished = {"final_eval_accuracy": 0.75, "stopped_by_signal": None, "wall_seconds": 30.0}

    assert _run_job(sw, "0", 0, ["algo.lr=1e-3"], lambda cfg: finished) == 0.75
    assert _run_job(sw, "1", 1, ["algo.lr=3e-3"], lambda cfg: stopped) is None
    record = json.loads((sw / "1" / sweep.STATUS_FILE).read_text())
    assert (record["status"], record["error"]) == ("stopped", "stopped by signal 15")

    sweep.SweepSummaryCallback().on_multirun_end(_hydra_cfg(sw))

    assert sweep.failed_jobs() == ["algo.lr=3e-3"]
    assert [r["status"] for r in _rows(sw)] == ["ok", "stopped"]


def test_jobs_with_the_same_swept_values_each_get_a_reward_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs with identical swept values (a repeat, an Optuna trial sampling a point again) are two lines of
    rewards.png, each named by its job number (one overwrote the other)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    sw = tmp_path / "sweep"
    for num, group in enumerate([4, 8, 4]):
        metrics = [{"step": s, "reward/mean": 0.1 * s * (num + 1)} for s in range(1, 4)]
        _job(sw, str(num), num, [f"algo.group_size={group}", "experiment=t"], metrics=metrics, wall_seconds=1.0)
    plotted: list[tuple[str, list[float]]] = []
    savefig = Figure.savefig

    def record(fig: Any, *args: Any, **kwargs: Any) -> Any:
        ax = fig.axes[0]
        plotted.extend((line.get_label(), [round(y, 6) for y in line.get_ydata()]) for line in ax.get_lines())
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    sweep.summarize(sw)

    assert plotted == [
        ("0: algo.group_size=4", [0.1, 0.2, 0.3]),
        ("1: algo.group_size=8", [0.2, 0.4, 0.6]),
        ("2: algo.group_size=4", [0.3, 0.6, 0.9]),
    ]
    assert (sw / "rewards.png").stat().st_size > 0


def test_a_sweep_run_again_into_its_folder_summarises_only_its_own_jobs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three failing jobs, then one failing job into the same hydra.sweep.dir: the second sweep's summary and
    failure count hold its one job (they held all three: its job 0 and the first sweep's jobs 1 and 2), and the
    earlier records are named in a warning."""
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(_hydra_cfg(sw))
    for num, name in enumerate("abc"):
        assert _run_job(sw, str(num), num, [f"env.path=/x/{name}.jsonl"], _fails) is None
    callback.on_multirun_end(_hydra_cfg(sw))
    assert len(sweep.failed_jobs()) == 3
    sweep._failed_jobs.clear()  # a new roll-train process

    callback.on_multirun_start(_hydra_cfg(sw))
    _run_job(sw, "0", 0, ["env.path=/x/z.jsonl"], _fails)
    with caplog.at_level(logging.WARNING, logger="roll_core.sweep"):
        callback.on_multirun_end(_hydra_cfg(sw))

    assert sweep.failed_jobs() == ["env.path=/x/z.jsonl"]
    assert [(r["job"], r["params"]) for r in _rows(sw)] == [("0", "env.path=/x/z.jsonl")]
    assert "2 job record(s)" in caplog.text and "earlier sweep" in caplog.text
    assert caplog.text.count("earlier sweep") == 1  # once per sweep, not once per reader


def test_an_unreadable_job_record_counts_as_a_failure_unless_it_is_older_than_the_sweep(tmp_path: Path) -> None:
    """A job_status.json that does not parse is a job whose outcome is unknown: a failure when this sweep wrote it,
    a stale leftover (left out) when it predates the sweep."""
    import os

    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(_hydra_cfg(sw))
    _run_job(sw, "0", 0, ["algo.lr=1e-3"], lambda cfg: {"final_eval_accuracy": 0.5})
    (sw / "1").mkdir()
    (sw / "1" / sweep.STATUS_FILE).write_text('{"job": 1, "overr')
    (sw / "2").mkdir()
    (sw / "2" / sweep.STATUS_FILE).write_text('{"job": 2, "overr')
    old = time.time() - 3600  # written an hour before this sweep started
    os.utime(sw / "2" / sweep.STATUS_FILE, (old, old))

    callback.on_multirun_end(_hydra_cfg(sw))

    assert len(sweep.failed_jobs()) == 1 and sweep.failed_jobs()[0].startswith("1: unreadable job_status.json")
    assert [r["status"] for r in _rows(sw)] == ["ok"]


def test_summary_md_keeps_the_whole_params_column(tmp_path: Path) -> None:
    """With several swept parameters the values that tell jobs apart come late in the label: summary.md keeps the
    params column whole (it cut every cell at 120 characters); a long error is still cut."""
    sw = tmp_path / "sweep"
    for num in range(4):
        overrides = [
            f"model.path=/mnt/shared/models/Qwen2.5-{('0.5B', '1.5B')[num // 2]}-Instruct",
            f"algo.kl_coef={0.001 if num % 2 else 0.0}",
            f"env.path=/data/bench/math_train_{num // 2}.jsonl",
            f"algo.lr={(1, 3)[num % 2]}e-6",
        ]
        _job(sw, str(num), num, overrides, "failed", wall_seconds=1.0, error="ValueError: " + "x" * 300)

    rows = sweep.summarize(sw)

    md = (sw / "summary.md").read_text().splitlines()[2:]
    assert len(rows) == 4 and all(len(r["params"]) > 120 for r in rows)
    for row, line in zip(rows, md):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert cells[1] == row["params"]  # the whole label, its last override (algo.lr) included
        assert cells[-1] == ("ValueError: " + "x" * 300)[:120]
    assert len({line.split(" | ")[1] for line in md}) == 4


def test_a_job_that_fails_before_it_runs_is_recorded_and_summarised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception while a job is prepared or takes its slot (here: the slots actor died) is recorded as a failed
    job and gives the sweeper None, like one raised by its run. It escaped run_sweep_job: Hydra's sweeper then raised,
    the sweep's summary was never written and the job had no record."""
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(_hydra_cfg(sw))
    real_slot = sweep.job_slot

    def slot(name: str, permits: int, **kwargs: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.get().job.num == 1:
            raise RuntimeError("the slots actor died")
        return real_slot(name, permits, **kwargs)

    monkeypatch.setattr(sweep, "job_slot", slot)

    def ok(cfg: Any) -> dict[str, Any]:
        return {"final_eval_accuracy": 0.5}

    assert _run_job(sw, "0", 0, ["algo.lr=1e-3"], ok) == 0.5
    assert _run_job(sw, "1", 1, ["algo.lr=3e-3"], ok) is None  # its slot could not be taken
    callback.on_multirun_end(_hydra_cfg(sw))

    record = json.loads((sw / "1" / sweep.STATUS_FILE).read_text())
    assert (record["status"], record["error"]) == ("failed", "RuntimeError: the slots actor died")
    assert record["sweep_id"] == sweep.sweep_marker(sw)["sweep_id"]  # counted as this sweep's job
    assert sweep.failed_jobs() == ["algo.lr=3e-3"]
    rows = _rows(sw)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "failed")]
    assert rows[1]["wall_seconds"] == ""  # it never ran: no wall time, not a fake 0


def test_a_job_lost_after_it_ended_keeps_its_record(tmp_path: Path) -> None:
    """Ray can lose a job after it wrote its end record (its process dies on its way out, its result is lost with
    its node): the job keeps its `ok` record and the sweeper gets its accuracy. killed() overwrote the record, so a
    finished job was summarised as killed and roll-train exited 1. A job lost while running is still killed."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="install roll-core[sweep]")
    from roll_core import sweep_launcher

    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(_hydra_cfg(sw))
    assert _run_job(sw, "0", 0, ["algo.lr=1e-3"], lambda cfg: {"final_eval_accuracy": 0.75}) == 0.75
    start: dict[str, Any] = {}

    def run(cfg: Any) -> dict[str, Any]:  # job 1's start record, as a SIGKILL during training leaves it
        start.update(json.loads((sw / "1" / sweep.STATUS_FILE).read_text()))
        return {"final_eval_accuracy": 0.5}

    _run_job(sw, "1", 1, ["algo.lr=3e-3"], run)
    (sw / "1" / sweep.STATUS_FILE).write_text(json.dumps(start))
    lost = RuntimeError("ObjectLostError: the node holding the result died")
    returns = []
    for num in (0, 1):
        cfg = OmegaConf.create(
            {"hydra": {"sweep": {"dir": str(sw), "subdir": "${hydra.job.num}"}, "job": {"num": num}}}
        )
        returns.append(sweep_launcher.killed(cfg, [f"algo.lr={num * 2 + 1}e-3"], lost).return_value)
    callback.on_multirun_end(_hydra_cfg(sw))

    assert returns[0] == 0.75 and returns[1] is None
    assert [(r["job"], r["status"]) for r in _rows(sw)] == [("0", "ok"), ("1", "killed")]
    assert sweep.failed_jobs() == ["algo.lr=3e-3"]


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


def test_a_signal_that_stops_a_local_sweep_job_stops_the_sweep(tmp_path: Path) -> None:
    """Ctrl-C (or a scheduler's SIGTERM) in a local multirun stops the running job at a checkpoint; the sweep's later
    jobs are then not started but recorded as stopped, so the sweep ends, is summarised and exits non-zero. The next
    job started instead: one Ctrl-C per job to stop a sweep. A new sweep into the folder runs again."""
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(_hydra_cfg(sw))
    ran: list[int] = []

    def run(num: int, signum: int | None) -> Any:
        def job(cfg: Any) -> dict[str, Any]:
            ran.append(num)
            return {"final_eval_accuracy": 0.5, "stopped_by_signal": signum}

        return job

    assert _run_job(sw, "0", 0, ["algo.lr=1e-3"], run(0, None)) == 0.5
    assert _run_job(sw, "1", 1, ["algo.lr=2e-3"], run(1, 2)) is None  # Ctrl-C during job 1
    assert _run_job(sw, "2", 2, ["algo.lr=3e-3"], run(2, None)) is None
    callback.on_multirun_end(_hydra_cfg(sw))

    assert ran == [0, 1]
    record = json.loads((sw / "2" / sweep.STATUS_FILE).read_text())
    assert record["status"] == "stopped"
    assert record["error"] == "not started: the sweep was stopped by signal 2 during job 1"
    rows = _rows(sw)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "stopped"), ("2", "stopped")]
    assert rows[2]["wall_seconds"] == ""  # it never ran: no wall time, not a fake 0
    assert sweep.failed_jobs() == ["algo.lr=2e-3", "algo.lr=3e-3"]

    callback.on_multirun_start(_hydra_cfg(sw))  # run again: its jobs start
    assert _run_job(sw, "0", 0, ["algo.lr=3e-3"], run(3, None)) == 0.5
    assert ran == [0, 1, 3]


def test_nan_metrics_are_never_the_best_and_give_the_sweeper_no_value(tmp_path: Path) -> None:
    """A NaN reward or accuracy (a step whose rewards all failed) was the job's best_* when it came first (max()
    keeps a leading NaN); a job that finished with a NaN (or no) final accuracy gave the sweeper NaN, which Optuna
    refuses. best_* skip NaN; the sweeper gets None (a failed trial)."""
    nan = math.nan
    sw = tmp_path / "sweep"
    metrics = [
        {"step": 1, "reward/mean": nan, "eval/accuracy": nan},
        {"step": 2, "reward/mean": 0.25, "eval/accuracy": 0.5},
        {"step": 3, "reward/mean": 0.5, "eval/accuracy": 0.25},
    ]
    _job(sw, "0", 0, ["algo.lr=1e-3"], metrics=metrics, wall_seconds=1.0)

    (row,) = sweep.summarize(sw)

    assert (row["best_reward"], row["best_eval_accuracy"]) == (0.5, 0.5)
    assert (row["final_reward"], row["final_eval_accuracy"]) == (0.5, 0.25)
    assert _run_job(sw, "1", 1, ["algo.lr=2e-3"], lambda cfg: {"final_eval_accuracy": nan}) is None
    assert _run_job(sw, "2", 2, ["algo.lr=3e-3"], lambda cfg: {"final_eval_accuracy": None}) is None
    assert _run_job(sw, "3", 3, ["algo.lr=4e-3"], lambda cfg: {"final_eval_accuracy": 1}) == 1.0


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
    assert [(r["job"], r["status"]) for r in _rows(sw)] == [("0", "failed"), ("1", "ok"), ("2", "ok")]


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
        callback.on_multirun_start(_hydra_cfg(sw))
        resume = {"pipeline": {"resume": True}} if "pipeline.resume=true" in shared else {}
        return [_run_job(sw, str(n), n, [f"algo.lr={lr}", *shared], run, **resume) for n, lr in enumerate(lrs)]

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
