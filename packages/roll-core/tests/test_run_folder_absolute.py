"""A relative run folder is made absolute once, by the driver, against its own working directory: the trainer's
workers (Ray actors whose working directory is a Ray session folder, possibly on another node) get absolute
checkpoint folders, and the run's records land in `<driver cwd>/<output_dir>`; roll-train keeps that folder also when
Hydra runs the job inside its run folder (hydra.job.chdir=true). And a checkpoint the trainer's ranks wrote only
part of is never one `latest()` (a resume) picks: completeness is the driver's state.json in a renamed `step_N`.

Ray-free: the folders the trainer's workers are handed are recorded where the driver hands them over,
`TrainGroup.save` / `TrainGroup.load` (a Ray worker receives that argument as it is, pickled)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from roll_core import cli
from roll_core.checkpoint import CheckpointManager
from roll_core.cluster.roles import TrainGroup
from roll_core.testing import constant_answer_task, tiny_overrides
from roll_core.testing.sweeps import root_logging_restored


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The folders the trainer's workers are asked to save into and load from, in order."""
    seen: dict[str, list[str]] = {"save": [], "load": []}
    save, load = TrainGroup.save, TrainGroup.load

    def spy_save(self: Any, folder: str, tokenizer_path: str | None = None) -> None:
        seen["save"].append(folder)
        save(self, folder, tokenizer_path)

    def spy_load(self: Any, folder: str) -> None:
        seen["load"].append(folder)
        load(self, folder)

    monkeypatch.setattr(TrainGroup, "save", spy_save)
    monkeypatch.setattr(TrainGroup, "load", spy_load)
    return seen


def _pipeline(*overrides: str) -> Any:
    from roll_core.cli import pipeline_class
    from roll_core.config import load_config

    cfg = load_config(list(overrides))
    return pipeline_class(cfg.pipeline.name)(cfg)


def test_a_relative_output_dir_reaches_the_workers_as_the_drivers_cwd_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handed: dict[str, list[str]]
) -> None:
    monkeypatch.chdir(tmp_path)
    constant_answer_task(tmp_path / "data.jsonl", rows=40)
    overrides = tiny_overrides("data.jsonl", "runs/a", "pipeline.max_steps=2", "pipeline.trackers=[]")
    run = tmp_path / "runs" / "a"
    pipeline = _pipeline(*overrides, "cluster=local")
    try:
        assert pipeline.out == run and pipeline.out.is_absolute()
        assert pipeline.ckpt.root == run / "checkpoints"
        pipeline.run()
    finally:
        pipeline.shutdown()
    # The step-2 checkpoint (the last step's) was handed to the workers as an absolute folder inside the run folder.
    assert handed["save"] == [str(run / "checkpoints" / "step_000002.tmp" / "actor")]
    assert (run / "checkpoints" / "step_000002" / "actor" / "model" / "config.json").is_file()
    for name in ("metrics.jsonl", "report.md", "config.yaml"):
        assert (run / name).is_file(), name
    # Nothing was written by a path resolved elsewhere: the working directory holds the data and the run folder only.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "runs"]

    # A relative pipeline.resume_from (a checkpoint folder) is made absolute too: the workers load it from there.
    resumed = _pipeline(
        *overrides, "cluster=local", "pipeline.resume_from=runs/a/checkpoints/step_000002", "pipeline.max_steps=3"
    )
    try:
        assert resumed.out == run and resumed.start_step == 3
    finally:
        resumed.shutdown()
    assert handed["load"] == [str(run / "checkpoints" / "step_000002" / "actor")]


@pytest.fixture
def hydra_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ROLL_CONF_DIR", str(tmp_path / "conf"))  # not the user's own conf folder
    (tmp_path / "conf").mkdir()
    with root_logging_restored():
        yield


@pytest.mark.parametrize("chdir", ["false", "true"])
@pytest.mark.usefixtures("hydra_isolated")
def test_roll_train_hands_the_pipeline_the_folder_under_the_launch_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chdir: str
) -> None:
    """hydra.job.chdir=true runs the job inside Hydra's run folder (here: the output_dir): a relative output_dir
    taken from there was `<run>/<run>`, away from .hydra/ and the folder the user named."""
    got: list[tuple[str, str]] = []

    class Recorder:
        def __init__(self, cfg: Any, output_dir: str | Path | None = None) -> None:
            got.append((os.getcwd(), str(output_dir)))
            self.out = output_dir

        def run(self) -> dict[str, Any]:
            return {"wall_seconds": 0.0}

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(cli, "pipeline_class", lambda name: Recorder)
    monkeypatch.setattr(sys, "argv", ["roll-train", "pipeline.output_dir=runs/a", f"hydra.job.chdir={chdir}"])
    cli.train_main()
    run = tmp_path / "runs" / "a"
    assert len(got) == 1
    cwd, output_dir = got[0]
    assert Path(cwd) == (run if chdir == "true" else tmp_path)  # Hydra did (not) change directory
    assert output_dir == str(run)
    assert (run / ".hydra" / "config.yaml").is_file()
    assert not (run / "runs").exists()


@pytest.mark.usefixtures("hydra_isolated")
def test_an_earlier_sweeps_failed_job_in_the_process_does_not_fail_this_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """failed_jobs() counts every sweep of the process: a single run after a sweep with a failed job (a second
    train_main in a notebook, the test suite's CI run of 2026-12-07) exited 1 naming the earlier sweep's job."""
    from roll_core import sweep

    class Done:
        def __init__(self, cfg: Any, output_dir: str | Path | None = None) -> None:
            self.out = output_dir

        def run(self) -> dict[str, Any]:
            return {"wall_seconds": 0.0}

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(sweep, "_failed_jobs", ["algo.lr=1"])  # an earlier sweep of this process
    monkeypatch.setattr(cli, "pipeline_class", lambda name: Done)
    monkeypatch.setattr(sys, "argv", ["roll-train", "pipeline.output_dir=runs/b"])
    cli.train_main()  # returns: no SystemExit(1)
    assert sweep.failed_jobs() == ["algo.lr=1"]


def test_a_checkpoint_the_ranks_wrote_part_of_is_never_the_latest(tmp_path: Path) -> None:
    """The trainer's ranks write their shards from their own nodes into `step_N.tmp/`; only the driver marks a
    checkpoint complete (state.json, then the rename to `step_N`), after every rank's save returned. What a failed or
    interrupted save leaves (a rank's shards, even the driver's state.json before its rename, a straggling rank that
    wrote into `.tmp` after the driver discarded it) is not listed, and the next save deletes it first."""
    m = CheckpointManager(tmp_path / "run")
    complete = m.commit(m.staging(4), 4, {"trainer": {}})
    # step 6: rank 1 wrote its shard, rank 0 failed; the driver discarded the folder, then the straggler wrote again
    tmp6 = m.staging(6)
    m.discard(tmp6)
    (tmp6 / "actor").mkdir(parents=True)
    (tmp6 / "actor" / "engine_rank1.pt").write_bytes(b"shard")
    # step 8: every rank wrote and the driver wrote state.json, then died before the rename
    tmp8 = m.root / "step_000008.tmp"
    (tmp8 / "actor" / "model").mkdir(parents=True)
    (tmp8 / "actor" / "model" / "model.safetensors").write_bytes(b"w")
    (tmp8 / "state.json").write_text('{"step": 8}')
    # step 9: a folder by the final name without the driver's state.json (a rank's write into a wrong path)
    (m.root / "step_000009" / "actor").mkdir(parents=True)

    assert m.list() == [complete] and m.latest() == complete
    m.staging(10)  # the next save, on the driver: the left-overs are deleted before it writes anything
    assert sorted(p.name for p in m.root.iterdir()) == ["step_000004", "step_000009", "step_000010.tmp"]
    assert m.latest() == complete
