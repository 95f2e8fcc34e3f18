"""The sweep summary and failure count (roll_core.sweep), on hand-made job folders: no training, no Ray.

Each test builds what a sweep leaves on disk (job_status.json records, metrics.jsonl) or runs the job wrapper
`run_sweep_job` with a fake `run` (roll_core.testing.sweeps.run_job), then calls `SweepSummaryCallback` the way Hydra
does after a multirun, and checks summary.csv / summary.md / rewards.png and `failed_jobs()` (non-empty: roll-train
exits 1). How the jobs are launched, stopped, resumed and told to Optuna: test_sweep_jobs.py.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import roll_core.sweep as sweep
import roll_core.sweep_summary as sweep_summary
from roll_core.testing.sweeps import multirun_config, reset_sweep_state, run_job, summary_rows


@pytest.fixture(autouse=True)
def _fresh_sweep_state(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_sweep_state(monkeypatch)  # failed_jobs() and the started sweeps are per process: every test starts from none


def _job(sweep_dir: Path, folder: str, num: int, overrides: list[str], status: str = "ok", **extra: Any) -> Path:
    """A job folder as run_sweep_job leaves it; `metrics`: its metrics.jsonl records."""
    metrics = extra.pop("metrics", None)
    d = sweep_dir / folder
    d.mkdir(parents=True, exist_ok=True)
    (d / sweep.STATUS_FILE).write_text(json.dumps({"job": num, "overrides": overrides, "status": status, **extra}))
    if metrics is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return d


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

    sweep.SweepSummaryCallback().on_multirun_end(multirun_config(sw))

    assert sweep.failed_jobs() == ["env.path=/data/set_1.jsonl", "env.path=/data/set_10.jsonl"]
    assert [(r["job"], r["status"]) for r in summary_rows(sw)] == [
        ("0", "ok"),
        ("1", "failed"),
        ("2", "ok"),
        ("10", "failed"),
    ]

    empty = tmp_path / "lost"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(multirun_config(empty))
    callback.on_multirun_end(multirun_config(empty))
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

    def broken_write(*args: Any) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(sweep_summary, "_replace_atomically", broken_write)
    with caplog.at_level(logging.ERROR, logger="roll_core.sweep"):
        sweep.SweepSummaryCallback().on_multirun_end(multirun_config(sw))  # must not raise

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

    run_job(sw, "0", 0, ["algo.lr=3e-3"], run)
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

    assert run_job(sw, "0", 0, ["algo.lr=1e-3"], lambda cfg: finished) == 0.75
    assert run_job(sw, "1", 1, ["algo.lr=3e-3"], lambda cfg: stopped) is None
    record = json.loads((sw / "1" / sweep.STATUS_FILE).read_text())
    assert (record["status"], record["error"]) == ("stopped", "stopped by signal 15")

    sweep.SweepSummaryCallback().on_multirun_end(multirun_config(sw))

    assert sweep.failed_jobs() == ["algo.lr=3e-3"]
    assert [r["status"] for r in summary_rows(sw)] == ["ok", "stopped"]


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
    callback.on_multirun_start(multirun_config(sw))
    for num, name in enumerate("abc"):
        assert run_job(sw, str(num), num, [f"env.path=/x/{name}.jsonl"], _fails) is None
    callback.on_multirun_end(multirun_config(sw))
    assert len(sweep.failed_jobs()) == 3
    sweep._failed_jobs.clear()  # a new roll-train process

    callback.on_multirun_start(multirun_config(sw))
    run_job(sw, "0", 0, ["env.path=/x/z.jsonl"], _fails)
    with caplog.at_level(logging.WARNING, logger="roll_core.sweep"):
        callback.on_multirun_end(multirun_config(sw))

    assert sweep.failed_jobs() == ["env.path=/x/z.jsonl"]
    assert [(r["job"], r["params"]) for r in summary_rows(sw)] == [("0", "env.path=/x/z.jsonl")]
    assert "2 job record(s)" in caplog.text and "earlier sweep" in caplog.text
    assert caplog.text.count("earlier sweep") == 1  # once per sweep, not once per reader


def test_an_unreadable_job_record_counts_as_a_failure_unless_it_is_older_than_the_sweep(tmp_path: Path) -> None:
    """A job_status.json that does not parse is a job whose outcome is unknown: a failure when this sweep wrote it,
    a stale leftover (left out) when it predates the sweep."""
    import os

    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(multirun_config(sw))
    run_job(sw, "0", 0, ["algo.lr=1e-3"], lambda cfg: {"final_eval_accuracy": 0.5})
    (sw / "1").mkdir()
    (sw / "1" / sweep.STATUS_FILE).write_text('{"job": 1, "overr')
    (sw / "2").mkdir()
    (sw / "2" / sweep.STATUS_FILE).write_text('{"job": 2, "overr')
    old = time.time() - 3600  # written an hour before this sweep started
    os.utime(sw / "2" / sweep.STATUS_FILE, (old, old))

    callback.on_multirun_end(multirun_config(sw))

    assert len(sweep.failed_jobs()) == 1 and sweep.failed_jobs()[0].startswith("1: unreadable job_status.json")
    assert [r["status"] for r in summary_rows(sw)] == ["ok"]


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
    callback.on_multirun_start(multirun_config(sw))
    real_slot = sweep.job_slot

    def slot(name: str, permits: int, **kwargs: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.get().job.num == 1:
            raise RuntimeError("the slots actor died")
        return real_slot(name, permits, **kwargs)

    monkeypatch.setattr(sweep, "job_slot", slot)

    def ok(cfg: Any) -> dict[str, Any]:
        return {"final_eval_accuracy": 0.5}

    assert run_job(sw, "0", 0, ["algo.lr=1e-3"], ok) == 0.5
    assert run_job(sw, "1", 1, ["algo.lr=3e-3"], ok) is None  # its slot could not be taken
    callback.on_multirun_end(multirun_config(sw))

    record = json.loads((sw / "1" / sweep.STATUS_FILE).read_text())
    assert (record["status"], record["error"]) == ("failed", "RuntimeError: the slots actor died")
    assert record["sweep_id"] == sweep.sweep_marker(sw)["sweep_id"]  # counted as this sweep's job
    assert sweep.failed_jobs() == ["algo.lr=3e-3"]
    rows = summary_rows(sw)
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
    callback.on_multirun_start(multirun_config(sw))
    assert run_job(sw, "0", 0, ["algo.lr=1e-3"], lambda cfg: {"final_eval_accuracy": 0.75}) == 0.75
    start: dict[str, Any] = {}

    def run(cfg: Any) -> dict[str, Any]:  # job 1's start record, as a SIGKILL during training leaves it
        start.update(json.loads((sw / "1" / sweep.STATUS_FILE).read_text()))
        return {"final_eval_accuracy": 0.5}

    run_job(sw, "1", 1, ["algo.lr=3e-3"], run)
    (sw / "1" / sweep.STATUS_FILE).write_text(json.dumps(start))
    lost = RuntimeError("ObjectLostError: the node holding the result died")
    returns = []
    for num in (0, 1):
        cfg = OmegaConf.create(
            {"hydra": {"sweep": {"dir": str(sw), "subdir": "${hydra.job.num}"}, "job": {"num": num}}}
        )
        returns.append(sweep_launcher.killed(cfg, [f"algo.lr={num * 2 + 1}e-3"], lost).return_value)
    callback.on_multirun_end(multirun_config(sw))

    assert returns[0] == 0.75 and returns[1] is None
    assert [(r["job"], r["status"]) for r in summary_rows(sw)] == [("0", "ok"), ("1", "killed")]
    assert sweep.failed_jobs() == ["algo.lr=3e-3"]


def test_a_sweep_its_sweeper_ended_is_summarised_from_one_read_of_its_job_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sweeper that raises (Optuna with every trial failed) skips on_multirun_end; roll-train then ends the sweep
    with end_unfinished_sweeps, which read every job record of the folder to tell whether any job ran, and end_sweep
    read them all again (and warned twice about an earlier sweep's record). One read, handed on: the same failures
    and summary as on_multirun_end gives."""
    sw = tmp_path / "sweep"
    _job(sw, "old", 7, ["algo.lr=9e-3"], sweep_id="an-earlier-sweep")
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(multirun_config(sw))
    run_job(sw, "0", 0, ["algo.lr=1e-3"], _fails)
    run_job(sw, "1", 1, ["algo.lr=2e-3"], lambda cfg: {"final_eval_accuracy": 0.5})
    reads: list[Path] = []
    real = sweep.job_records

    def job_records(sweep_dir: Any, *args: Any) -> Any:
        reads.append(Path(sweep_dir))
        return real(sweep_dir, *args)

    monkeypatch.setattr(sweep, "job_records", job_records)
    with caplog.at_level(logging.WARNING, logger="roll_core.sweep"):
        ended = sweep.end_unfinished_sweeps(RuntimeError("No trials are completed yet"))

    assert ended == [(sw.resolve() / "summary.md", ["algo.lr=1e-3"])] and sweep.failed_jobs() == ["algo.lr=1e-3"]
    assert reads == [sw.resolve()]
    assert [(r["job"], r["status"]) for r in summary_rows(sw)] == [("0", "failed"), ("1", "ok")]
    stale = [r for r in caplog.records if "from an earlier sweep into the same folder" in r.getMessage()]
    assert len(stale) == 1 and "old" in stale[0].getMessage()
    assert sweep.end_unfinished_sweeps(RuntimeError("again")) == []  # ended: not summarised twice


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
    assert run_job(sw, "1", 1, ["algo.lr=2e-3"], lambda cfg: {"final_eval_accuracy": nan}) is None
    assert run_job(sw, "2", 2, ["algo.lr=3e-3"], lambda cfg: {"final_eval_accuracy": None}) is None
    assert run_job(sw, "3", 3, ["algo.lr=4e-3"], lambda cfg: {"final_eval_accuracy": 1}) == 1.0


def test_a_plot_that_fails_is_logged_and_the_summary_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A savefig that fails half-way (a full disk, a broken backend) raised out of the summary (summarize() failed a
    sweep whose jobs had all finished) and left a half-written rewards.png over the earlier one. Now it is logged,
    summary.csv and summary.md are written, the earlier rewards.png is kept whole and no temporary file is left."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    sw = tmp_path / "sweep"
    for num in range(2):
        metrics = [{"step": s, "reward/mean": 0.25 * s} for s in (1, 2)]
        _job(sw, str(num), num, [f"algo.lr={num + 1}e-3"], metrics=metrics, wall_seconds=1.0)
    (sw / "rewards.png").write_bytes(b"earlier picture")

    def half_savefig(fig: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError("No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_savefig)
    with caplog.at_level(logging.ERROR, logger="roll_core.sweep"):
        rows = sweep.summarize(sw)  # must not raise

    assert [(r["job"], r["final_reward"]) for r in rows] == [(0, 0.5), (1, 0.5)]
    assert [r["status"] for r in summary_rows(sw)] == ["ok", "ok"]
    assert (sw / "summary.md").read_text().count("| ok |") == 2
    assert (sw / "rewards.png").read_bytes() == b"earlier picture"
    assert "rewards.png" in caplog.text and "No space left on device" in caplog.text
    assert sorted(p.name for p in sw.iterdir() if p.is_file()) == ["rewards.png", "summary.csv", "summary.md"]


def test_a_summary_cut_off_while_it_is_written_leaves_the_earlier_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """summary.csv and summary.md were written in place: a sweep killed (or failing) while writing them left half a
    table over the earlier, complete one. Each is written to a temporary file in the sweep folder and renamed over
    it: the earlier summary stays whole and no temporary file is left."""
    import csv

    sw = tmp_path / "sweep"
    for num in range(3):
        _job(sw, str(num), num, [f"algo.lr={num + 1}e-3"], wall_seconds=1.0)
    monkeypatch.setattr(sweep_summary, "_plot", lambda curves, path: None)
    sweep.summarize(sw)
    before = {name: (sw / name).read_text() for name in ("summary.csv", "summary.md")}
    _job(sw, "3", 3, ["algo.lr=4e-3"], "failed", error="RuntimeError: no data")

    def cut_off(writer: Any, rows: Any) -> None:
        writer.writerow(next(iter(rows)))
        raise OSError("killed")

    writerows = csv.DictWriter.writerows
    monkeypatch.setattr(csv.DictWriter, "writerows", cut_off)
    with pytest.raises(OSError, match="killed"):
        sweep.summarize(sw)
    assert {name: (sw / name).read_text() for name in before} == before
    monkeypatch.setattr(csv.DictWriter, "writerows", writerows)
    write_text = Path.write_text

    def half_text(path: Path, text: str, *args: Any, **kwargs: Any) -> int:
        write_text(path, text[: len(text) // 2])
        raise OSError("killed")

    monkeypatch.setattr(Path, "write_text", half_text)  # summary.md cut off half-way
    with pytest.raises(OSError, match="killed"):
        sweep.summarize(sw)
    monkeypatch.setattr(Path, "write_text", write_text)
    assert (sw / "summary.md").read_text() == before["summary.md"]
    assert len(summary_rows(sw)) == 4  # the csv was written whole before the table failed
    assert sorted(p.name for p in sw.iterdir() if p.is_file()) == ["summary.csv", "summary.md"]


def test_a_sweep_with_no_job_record_never_shows_an_earlier_sweeps_summary(tmp_path: Path) -> None:
    """A sweep run again into a folder that found no job record of its own wrote no summary: the earlier sweep's
    summary.md, summary.csv and rewards.png stayed, and the log (and a stopped sweep's one line) pointed to them as
    this sweep's. summary.md now says there is none, and the earlier tables and plot are gone."""
    pytest.importorskip("matplotlib")
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(multirun_config(sw))
    run_job(sw, "0", 0, ["algo.lr=1e-3"], lambda cfg: {"final_eval_accuracy": 0.5})
    callback.on_multirun_end(multirun_config(sw))
    assert {p.name for p in sw.iterdir()} >= {"summary.md", "summary.csv", "rewards.png"}

    for stopped in (False, True):  # again, with no job: ended normally, then by a signal
        callback.on_multirun_start(multirun_config(sw))
        sweep_id = sweep.sweep_marker(sw)["sweep_id"]
        if stopped:
            sweep.stop_sweep(sw, 15, "the sweep was stopped by signal 15")
            with pytest.raises(SystemExit) as stop:
                callback.on_multirun_end(multirun_config(sw))
            assert "0 job(s)" in stop.value.report and str(sw / "summary.md") in stop.value.report
        else:
            callback.on_multirun_end(multirun_config(sw))
        summary = (sw / "summary.md").read_text()
        assert "algo.lr=1e-3" not in summary
        assert f"No job record (job_status.json) of sweep {sweep_id} was found" in summary
        assert not (sw / "summary.csv").exists() and not (sw / "rewards.png").exists()
    assert sweep.failed_jobs() == [f"no job_status.json of this sweep found under {sw}"] * 2
