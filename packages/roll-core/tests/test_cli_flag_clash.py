"""roll-train's one-line usage errors: flags Hydra refuses together (`-m` with `--cfg job`) were a Hydra traceback
with exit 1, and a bad sweep override's explained message ended in a stray `None` line (antlr's message-less
exception in the cause chain, roll_core.config.compose.explain)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from roll_core import cli
from roll_core.testing.sweeps import reset_sweep_state, root_logging_restored


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    reset_sweep_state(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with root_logging_restored():
        yield


def _train(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    def run(cfg: Any) -> Any:  # never reached: each command here is refused first
        raise AssertionError("the job ran")

    monkeypatch.setattr(cli, "run_job", run)
    monkeypatch.setattr(sys, "argv", ["roll-train", *args])
    with pytest.raises(SystemExit) as exit_:
        cli.train_main()
    return int(exit_.value.code or 0)


@pytest.mark.parametrize("args", [["-m", "algo.lr=1e-6,2e-6", "--cfg", "job"], ["--cfg", "all", "-m"]])
def test_multirun_with_cfg_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    code = _train(monkeypatch, *args)
    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("roll-train: -m/--multirun and --cfg ") and "cannot be used together" in lines[0]
    assert "leave out -m" in lines[0]


def test_other_clashes_and_lines_without_one() -> None:
    from roll_core.cli_dry_run import command_line_clash

    assert "--info" in (command_line_clash(["--info", "--cfg", "job"]) or "")
    assert "--resolve only goes with --cfg" in (command_line_clash(["--resolve"]) or "")
    assert command_line_clash(["-m", "algo.lr=1,2"]) is None
    assert command_line_clash(["--cfg", "job", "--resolve"]) is None
    assert command_line_clash(["-m", "--cfg", "job", "--help"]) is None  # --help wins in Hydra: no clash said


def test_a_bad_sweep_override_has_no_stray_none_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = _train(monkeypatch, "-m", "algo.lr=range(1", f"hydra.sweep.dir={tmp_path / 'sw'}")
    err = capsys.readouterr().err
    assert code == 2
    assert "no viable alternative at input 'range(1'" in err
    assert "None" not in err.splitlines(), err
    assert err.rstrip().splitlines()[-1].startswith("See https://hydra.cc/")
