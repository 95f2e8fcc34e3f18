"""roll-train's command line before Hydra sees it: a given pipeline.output_dir is Hydra's run folder too, so no
outputs/<date>/<time>/ folder appears in the working directory (tests/e2e/test_cli.py checks it on real runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.cli import run_dir_overrides


def test_output_dir_becomes_hydras_run_dir() -> None:
    args = ["model=tiny", "pipeline.output_dir=runs/a b", "algo.lr=1e-5"]
    assert run_dir_overrides(args) == [*args[:2], "hydra.run.dir=runs/a b", args[2]]
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


def test_a_home_relative_output_dir_is_expanded(monkeypatch) -> None:
    """The shell leaves `pipeline.output_dir=~/runs/a` as typed (a tilde after `=` is expanded only in variable
    assignments): the run wrote into a folder literally named `~` in the working directory."""
    monkeypatch.setenv("HOME", "/home/user")
    assert run_dir_overrides(["model=tiny", "pipeline.output_dir=~/runs/a"]) == [
        "model=tiny",
        "pipeline.output_dir=/home/user/runs/a",
        "hydra.run.dir=/home/user/runs/a",
    ]
    # In a multirun too (each job has its own folder; the value still reaches the config), and `~` alone is null.
    assert run_dir_overrides(["-m", "++pipeline.output_dir=~/x"]) == ["-m", "++pipeline.output_dir=/home/user/x"]
    assert run_dir_overrides(["pipeline.output_dir=~", "env.path=~/data.jsonl"]) == [
        "pipeline.output_dir=~",
        "env.path=~/data.jsonl",
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["pipeline.output_dir=/x", "--cfg", "job"],
        ["--cfg", "job", "model=tiny", "pipeline.output_dir=/x", "algo.lr=1e-5"],
        ["model=tiny", "pipeline.output_dir=/x", "--info", "searchpath"],
        ["algo.lr=1e-5", "--help"],
    ],
)
def test_the_added_overrides_keep_hydras_command_line_parseable(args: list[str]) -> None:
    """Hydra's argparse takes the overrides as one run of positionals: hydra.run.dir (or the help page's option)
    appended after a flag (`roll-train pipeline.output_dir=x --cfg job`) was "unrecognized arguments", exit 2."""
    from hydra._internal.utils import get_args_parser

    from roll_core.cli import _with_override

    added = _with_override(run_dir_overrides(args), "hydra/help=roll_train")
    parsed = get_args_parser().parse_args(added)
    assert "hydra/help=roll_train" in parsed.overrides
    assert ("hydra.run.dir=/x" in parsed.overrides) == ("pipeline.output_dir=/x" in args)


def test_a_checkpoint_that_cannot_be_written_stops_roll_train_with_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk during a save (CheckpointError: its message names the intact checkpoint) printed a traceback
    before that message; it is now the one line, exit 1, as a reward that failed for too long."""
    import sys

    from roll_core import cli
    from roll_core.checkpoint import CheckpointError

    def full(cfg: object) -> None:
        raise CheckpointError("step 4: the checkpoint could not be written (No space left on device); ...")

    from roll_core.testing.sweeps import root_logging_restored

    monkeypatch.setattr(cli, "run_job", full)
    monkeypatch.setattr(sys, "argv", ["roll-train", f"pipeline.output_dir={tmp_path / 'run'}"])
    with root_logging_restored(), pytest.raises(SystemExit) as exit_:  # Hydra's job logging adds root handlers
        cli.train_main()
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "Traceback" not in err
    assert "roll-train: run stopped: step 4: the checkpoint could not be written (No space left on device)" in err


def test_a_home_relative_output_dir_from_a_config_is_expanded(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pipeline.output_dir: ~/runs/a` in a YAML or the Python API (the CLI expands its own argument) wrote into a
    folder named `~` in the working directory."""
    from roll_core.config import load_config
    from roll_core.pipelines import loop

    seen: list[Path] = []

    class Stop(Exception):
        pass

    def capture(out: Path, *args: object, **kwargs: object) -> Path:
        seen.append(out)
        raise Stop

    monkeypatch.setattr(loop, "resolve_run_folder", capture)
    import dataclasses

    cfg = load_config(["model=tiny"])
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, output_dir="~/runs/a"))
    with pytest.raises(Stop):
        loop.Pipeline(cfg)
    assert seen == [Path.home() / "runs" / "a"]


def test_a_run_that_trained_nothing_for_too_long_stops_roll_train_with_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pipeline.max_empty_steps reached (EmptyStepsError: its message says why and what to do): one line, exit 1,
    no traceback, as a checkpoint that cannot be written."""
    import sys

    from roll_core import cli
    from roll_core.pipelines.empty_steps import EmptyStepsError
    from roll_core.testing.sweeps import root_logging_restored

    def empty(cfg: object) -> None:
        raise EmptyStepsError("step 5: 5 steps in a row trained nothing (pipeline.max_empty_steps=5): ...")

    monkeypatch.setattr(cli, "run_job", empty)
    monkeypatch.setattr(sys, "argv", ["roll-train", f"pipeline.output_dir={tmp_path / 'run'}"])
    with root_logging_restored(), pytest.raises(SystemExit) as exit_:
        cli.train_main()
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "Traceback" not in err
    assert "roll-train: run stopped: step 5: 5 steps in a row trained nothing" in err
