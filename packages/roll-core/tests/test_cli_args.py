"""roll-train's command line before Hydra sees it: a given pipeline.output_dir is Hydra's run folder too, so no
outputs/<date>/<time>/ folder appears in the working directory (tests/e2e/test_cli.py checks it on real runs)."""

from __future__ import annotations

from roll_core.cli import run_dir_overrides


def test_output_dir_becomes_hydras_run_dir() -> None:
    args = ["model=tiny", "pipeline.output_dir=runs/a b", "algo.lr=1e-5"]
    assert run_dir_overrides(args) == [*args, "hydra.run.dir=runs/a b"]
    assert run_dir_overrides(["++pipeline.output_dir=/x", "pipeline.output_dir=/y"])[-1] == "hydra.run.dir=/y"


def test_left_alone_without_output_dir_with_an_explicit_run_dir_and_for_sweeps() -> None:
    for args in (
        ["model=tiny"],
        ["pipeline.output_dir=null"],
        ["pipeline.output_dir=/x", "hydra.run.dir=/elsewhere"],
        ["-m", "pipeline.output_dir=/x", "algo.lr=1e-5,1e-6"],
        ["--multirun", "pipeline.output_dir=/x"],
    ):
        assert run_dir_overrides(args) == args
