"""Two jobs of one sweep given one folder under Hydra's basic launcher (roll_core._sweep_folders): the second is
refused before it writes anything there, its failure recorded under its own number; the first job's record and run
stay its own. Each job is run_sweep_job with a fake `run` (roll_core.testing.sweeps.run_job) that refuses a folder
with checkpoints unless resumed, as roll_core.pipelines.run_control does; no Ray, no training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import roll_core.sweep as sweep
from roll_core._sweep_folders import folder_owner
from roll_core.testing.sweeps import multirun_config, reset_sweep_state, run_job, summary_rows


@pytest.fixture(autouse=True)
def _fresh_sweep_state(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_sweep_state(monkeypatch)


def _training(ran: list[tuple[int, str]]) -> Any:
    """A run that trains in its folder (a checkpoint, one metrics line of its job) and refuses a folder holding
    checkpoints unless pipeline.resume=true; `ran`: (job number, folder name) of each run."""

    def run(cfg: Any) -> dict[str, Any]:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        out = Path(hc.runtime.output_dir)
        if any(out.glob("checkpoints/*")) and not cfg.get("pipeline", {}).get("resume"):
            raise RuntimeError(f"{out} holds checkpoints: pass pipeline.resume=true")
        ran.append((int(hc.job.num), out.name))
        (out / "checkpoints" / "step_5").mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 5, "reward/mean": 0.1 * (hc.job.num + 1), "job": hc.job.num}) + "\n")
        return {"final_eval_accuracy": 0.5}

    return run


def _record(folder: Path) -> dict[str, Any]:
    return json.loads((folder / sweep.STATUS_FILE).read_text())


def test_a_job_given_another_jobs_folder_fails_without_replacing_its_record(tmp_path: Path) -> None:
    """`algo.lr=1e-3,1e-3,3e-3` with hydra.sweep.subdir=${hydra.job.override_dirname}: jobs 0 and 1 share a folder.
    Job 1 wrote its job_status.json over job 0's before its run refused the folder, so job 0 left the summary. Now
    job 1 fails without writing there, naming both jobs and the fix; the summary has all three jobs."""
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(multirun_config(sw))
    ran: list[tuple[int, str]] = []
    shared = "algo.lr=1e-3"

    assert run_job(sw, shared, 0, [shared], _training(ran)) == 0.5
    before = {p.name: p.read_bytes() for p in (sw / shared).iterdir() if p.is_file()}
    assert run_job(sw, shared, 1, [shared], _training(ran)) is None
    assert run_job(sw, "algo.lr=3e-3", 2, ["algo.lr=3e-3"], _training(ran)) == 0.5
    callback.on_multirun_end(multirun_config(sw))

    assert ran == [(0, shared), (2, "algo.lr=3e-3")]
    assert {p.name: p.read_bytes() for p in (sw / shared).iterdir() if p.is_file()} == before  # untouched
    assert (_record(sw / shared)["job"], _record(sw / shared)["status"]) == (0, "ok")
    refused = _record(sw / "refused_jobs" / "job_1")
    assert (refused["job"], refused["status"], refused["folder"]) == (1, "failed", str(sw / shared))
    error = refused["error"]
    assert error.startswith("ConfigError: sweep job 1 (algo.lr=1e-3) was given the folder")
    assert "of job 0 (algo.lr=1e-3) of the same sweep" in error
    assert "distinct values" in error and "hydra.sweep.subdir=${hydra.job.num}_${hydra.job.override_dirname}" in error
    rows = summary_rows(sw)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "failed"), ("2", "ok")]
    assert rows[0]["final_reward"] == "0.1" and rows[1]["final_reward"] == ""  # job 0's metrics are job 0's
    assert sweep.failed_jobs() == ["algo.lr=1e-3"]  # job 1's values (the summary tells it from job 0 by number)


def test_a_resumed_sweep_does_not_continue_another_jobs_run_and_still_resumes_its_own(tmp_path: Path) -> None:
    """With pipeline.resume=true the second job of a shared folder continued the first job's finished run and
    recorded it under its own values. Now it is refused; the first job still resumes its folder's run from the
    earlier sweep, and a job whose override-named folder an earlier sweep's job of another number ran (the values
    in another order) still continues it: across sweeps a folder is matched by its values (roll_core.sweep_resume)."""
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    ran: list[tuple[int, str]] = []
    callback.on_multirun_start(multirun_config(sw))
    for num, lr in enumerate(["1e-3", "3e-3"]):
        assert run_job(sw, f"algo.lr={lr}", num, [f"algo.lr={lr}"], _training(ran)) == 0.5
    callback.on_multirun_end(multirun_config(sw))

    callback.on_multirun_start(multirun_config(sw))
    resume = {"pipeline": {"resume": True}}
    jobs = [(0, "1e-3"), (1, "1e-3"), (2, "3e-3")]
    values = [
        run_job(sw, f"algo.lr={lr}", n, [f"algo.lr={lr}", "pipeline.resume=true"], _training(ran), **resume)
        for n, lr in jobs
    ]
    callback.on_multirun_end(multirun_config(sw))

    assert values == [0.5, None, 0.5]
    assert ran[2:] == [(0, "algo.lr=1e-3"), (2, "algo.lr=3e-3")]  # job 1 never ran in job 0's folder
    assert (_record(sw / "algo.lr=1e-3")["job"], _record(sw / "algo.lr=1e-3")["status"]) == (0, "ok")
    assert (
        "of job 0 (algo.lr=1e-3 pipeline.resume=true) of the same sweep"
        in _record(sw / "refused_jobs" / "job_1")["error"]
    )
    assert [(r["job"], r["status"]) for r in summary_rows(sw)] == [("0", "ok"), ("1", "failed"), ("2", "ok")]


def test_only_another_job_of_the_same_sweep_owns_a_folder(tmp_path: Path) -> None:
    """The same job again (its number and overrides: a retried task) and a record of an earlier sweep are no clash;
    without a sweep id (no sweep_id.json) sweeps cannot be told apart and nothing is refused."""
    (tmp_path / sweep.STATUS_FILE).write_text(json.dumps({"job": 0, "overrides": ["a=1"], "sweep_id": "s1"}))
    assert folder_owner(tmp_path, {"job": 0, "overrides": ["a=1"], "sweep_id": "s1"}) is None
    assert folder_owner(tmp_path, {"job": 1, "overrides": ["a=1"], "sweep_id": "s2"}) is None
    assert folder_owner(tmp_path, {"job": 1, "overrides": ["a=1"], "sweep_id": None}) is None
    assert folder_owner(tmp_path / "none", {"job": 1, "overrides": ["a=1"], "sweep_id": "s1"}) is None
    assert folder_owner(tmp_path, {"job": 1, "overrides": ["a=1"], "sweep_id": "s1"})["job"] == 0
    assert folder_owner(tmp_path, {"job": 0, "overrides": ["a=2"], "sweep_id": "s1"})["job"] == 0


def test_two_jobs_that_both_passed_the_record_check_meet_at_the_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parallel launcher (joblib), or jobs queued for a cluster.max_concurrent slot: job 0 has passed the record
    check but not yet written its record when job 1 of the same folder starts. Both ran in one folder (job 1's
    record then job 0's over it). Now job 0's claim, made at its check, refuses job 1; job 0 still runs."""
    sw = tmp_path / "sweep"
    callback = sweep.SweepSummaryCallback()
    callback.on_multirun_start(multirun_config(sw))
    ran: list[tuple[int, str]] = []
    shared = "algo.lr=1e-3"
    inner: list[float | None] = []
    real_check = sweep.check_resumed_folder

    def job_1_starts_meanwhile(cfg: Any, out: Path, sweep_dir: Path, record: dict[str, Any]) -> None:
        if record["job"] == 0:  # job 0 is between its check and its record: job 1 comes now
            inner.append(run_job(sw, shared, 1, [shared], _training(ran)))
        real_check(cfg, out, sweep_dir, record)

    monkeypatch.setattr(sweep, "check_resumed_folder", job_1_starts_meanwhile)
    assert run_job(sw, shared, 0, [shared], _training(ran)) == 0.5
    callback.on_multirun_end(multirun_config(sw))

    assert inner == [None] and ran == [(0, shared)]
    assert (_record(sw / shared)["job"], _record(sw / shared)["status"]) == (0, "ok")
    refused = _record(sw / "refused_jobs" / "job_1")
    assert refused["status"] == "failed" and "of job 0 (algo.lr=1e-3) of the same sweep" in refused["error"]
    assert [(r["job"], r["status"]) for r in summary_rows(sw)] == [("0", "ok"), ("1", "failed")]


def test_a_claim_is_atomic_and_the_same_job_finds_its_own(tmp_path: Path) -> None:
    """Of several jobs claiming one folder the first owns it: the others get its job and overrides; the same job
    again (a retried task) finds its own claim; another sweep claims the folder for itself; no sweep id, no claim;
    no temporary file is left behind."""
    from roll_core._sweep_folders import claim_folder

    job0 = {"job": 0, "overrides": ["a=1"], "sweep_id": "s1"}
    assert claim_folder(tmp_path / "f", job0) is None
    assert claim_folder(tmp_path / "f", dict(job0)) is None
    assert claim_folder(tmp_path / "f", {"job": 1, "overrides": ["a=1"], "sweep_id": "s1"}) == {
        "job": 0,
        "overrides": ["a=1"],
    }
    assert claim_folder(tmp_path / "f", {"job": 0, "overrides": ["a=2"], "sweep_id": "s1"})["job"] == 0
    assert claim_folder(tmp_path / "f", {"job": 3, "overrides": ["a=1"], "sweep_id": "s2"}) is None
    assert claim_folder(tmp_path / "g", {"job": 1, "overrides": ["a=1"], "sweep_id": None}) is None
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == [".roll_claim_s1.json", ".roll_claim_s2.json"]
    assert not (tmp_path / "g").exists()


def test_a_filesystem_without_hard_links_claims_by_exclusive_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some FUSE mounts refuse hard links (EPERM): the claim falls back to an exclusive create instead of failing
    every job of the sweep."""
    import errno
    import os

    from roll_core._sweep_folders import claim_folder

    def no_links(src: str, dst: str) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    assert claim_folder(tmp_path, {"job": 0, "overrides": ["a=1"], "sweep_id": "s1"}) is None
    assert claim_folder(tmp_path, {"job": 1, "overrides": ["a=1"], "sweep_id": "s1"}) == {
        "job": 0,
        "overrides": ["a=1"],
    }
    assert [p.name for p in tmp_path.iterdir()] == [".roll_claim_s1.json"]
