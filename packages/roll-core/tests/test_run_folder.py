"""roll-train's run folder is claimed before Hydra writes into it (roll_core.run_folder), however it was set: a folder
an experiment preset names (hydra.run.dir, or pipeline.output_dir) that another process holds is refused with the
folder left as it was; runs (and sweeps) started in the same second into Hydra's default time-stamped folder each run
in a folder of their own. roll-train runs for real (in this process, or as separate processes racing for the folder),
with the training run faked and Hydra's clock frozen where the test needs two launches in one second."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra.core.utils
import pytest
import yaml

from roll_core import cli
from roll_core.run_lock import LOCK_NAME
from roll_core.testing.held_folder import folder_held_elsewhere
from roll_core.testing.sweeps import reset_sweep_state, root_logging_restored

#: roll-train with Hydra's clock frozen (every launch in the same second) and a training run that stays in its folder
#: for a while (so that runs started together overlap); its arguments are roll-train's.
RACER = """
import datetime as dt, sys, time
import hydra.core.utils
class Frozen(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 1, 2, 3, 4, 5)
hydra.core.utils.datetime = Frozen
from roll_core import cli
def run(cfg):
    time.sleep(1.0)
    return {}
cli.run_job = run
sys.argv = ["roll-train", *sys.argv[1:]]
cli.train_main()
"""

STAMP = Path("2026-01-02") / "03-04-05"  # the frozen clock's default folder name (outputs/<date>/<time>)


class _Frozen(dt.datetime):
    @classmethod
    def now(cls, tz: Any = None) -> _Frozen:
        return cls(2026, 1, 2, 3, 4, 5)


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Hydra's default folders are relative to the working folder; a preset's conf folder is the user's (ROLL_CONF_DIR)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ROLL_CONF_DIR", str(tmp_path / "conf"))
    reset_sweep_state(monkeypatch)  # the sweeps and failures are per process
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    with root_logging_restored():
        yield


def _preset(tmp_path: Path, body: str) -> str:
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(f"# @package _global_\nexperiment: mine\n{body}")
    return "experiment=mine"


def _train(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, list[str]]:
    """roll-train `args` with the training run faked; returns its exit status and the folders its jobs ran in."""
    from hydra.core.hydra_config import HydraConfig

    ran: list[str] = []

    def run(cfg: Any) -> dict[str, Any]:
        ran.append(HydraConfig.get().runtime.output_dir)
        return {}

    monkeypatch.setattr(cli, "run_job", run)
    monkeypatch.setattr(sys, "argv", ["roll-train", *args])
    try:
        cli.train_main()
    except SystemExit as exit_:
        return int(exit_.code or 0), ran
    return 0, ran


def _lr(folder: Path) -> float:
    return float(yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())["algo"]["lr"])


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Path]:
    """A folder another live process holds the run-folder lock on, with what its run has written so far."""
    with folder_held_elsewhere(tmp_path / "run") as folder:
        yield folder


@pytest.mark.parametrize("key", ["hydra.run.dir", "pipeline.output_dir"])
def test_a_folder_in_use_that_a_preset_names_is_refused_untouched(
    key: str, held: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The early lock saw only folders named on the command line: a preset's hydra.run.dir had the running run's
    .hydra/config.yaml replaced before the pipeline refused the run (a preset's pipeline.output_dir put .hydra/ in a
    stray outputs/<date>/<time>/ instead)."""
    body = {"hydra.run.dir": "hydra:\n  run:\n    dir: {}\n", "pipeline.output_dir": "pipeline:\n  output_dir: {}\n"}
    preset = _preset(tmp_path, body[key].format(held))
    before = _tree(held)

    code, ran = _train(monkeypatch, preset, "algo.lr=3e-6")

    assert (code, ran) == (2, [])
    assert f"{held} is in use by another roll process" in capsys.readouterr().err
    assert _tree(held) == before
    assert not (tmp_path / "outputs").exists()


def test_a_presets_output_dir_is_the_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As with pipeline.output_dir on the command line, the run's .hydra/ record is in its own folder."""
    code, ran = _train(monkeypatch, _preset(tmp_path, f"pipeline:\n  output_dir: {tmp_path / 'mine'}\n"))

    assert (code, ran) == (0, [str(tmp_path / "mine")])
    assert (tmp_path / "mine" / ".hydra" / "overrides.yaml").is_file() and (tmp_path / "mine" / LOCK_NAME).is_file()
    assert not (tmp_path / "outputs").exists()


def test_runs_in_one_second_each_get_their_own_default_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two launches in one second shared Hydra's default outputs/<date>/<time>/: the second replaced the first's
    .hydra/ record (and was refused by the pipeline's lock, or the two wrote one folder). Each now has its own."""
    monkeypatch.setattr(hydra.core.utils, "datetime", _Frozen)
    runs = [_train(monkeypatch, f"algo.lr={lr}") for lr in (1e-6, 2e-6, 3e-6)]

    first = tmp_path / "outputs" / STAMP
    folders = [first, first.with_name(f"{first.name}_2"), first.with_name(f"{first.name}_3")]
    assert runs == [(0, [str(f)]) for f in folders]
    assert [_lr(f) for f in folders] == [1e-6, 2e-6, 3e-6]
    # a folder the user names is theirs: used as it is, existing or not (a resumed run's folder exists)
    for _ in range(2):
        assert _train(monkeypatch, f"pipeline.output_dir={tmp_path / 'named'}") == (0, [str(tmp_path / "named")])


def test_processes_started_together_each_get_their_own_default_folder(tmp_path: Path) -> None:
    """The same with real concurrent roll-train processes racing for the folder (an exclusive mkdir decides)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, f"algo.lr={lr}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for lr in (1e-6, 2e-6)
    ]
    results = [(*p.communicate(timeout=120), p.returncode) for p in procs]
    assert [r[2] for r in results] == [0, 0], [r[1][-2000:] for r in results]
    first = tmp_path / "outputs" / STAMP
    folders = [first, first.with_name(f"{first.name}_2")]
    assert sorted(p.name for p in first.parent.iterdir()) == [f.name for f in folders]
    assert sorted(_lr(f) for f in folders) == [1e-6, 2e-6]
    for f in folders:  # each record names its own folder
        assert yaml.safe_load((f / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["output_dir"] == str(f)


def test_a_sweep_in_the_same_second_gets_its_own_default_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's jobs are composed again from the overrides: the new sweep folder reaches every job (a job of the
    sweep started in the same second is in the taken folder)."""
    monkeypatch.setattr(hydra.core.utils, "datetime", _Frozen)
    taken = tmp_path / "multirun" / STAMP
    (taken / "0").mkdir(parents=True)
    before = _tree(taken)

    code, ran = _train(monkeypatch, "-m", "algo.lr=3e-6")

    folder = taken.with_name(f"{taken.name}_2")
    assert (code, ran) == (0, [str(folder / "0")])
    assert _lr(folder / "0") == 3e-6 and (folder / LOCK_NAME).is_file()
    assert _tree(taken) == before


def test_flags_that_run_nothing_neither_lock_nor_create_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--cfg job` and `--info` only print: they may look at a folder a run is using, and create none."""
    folder = tmp_path / "run"
    for args in ([f"hydra.run.dir={folder}", "--cfg", "job"], ["--info", "config", f"pipeline.output_dir={folder}"]):
        assert _train(monkeypatch, *args) == (0, [])
    assert not folder.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("where", ["command line", "preset"])
def test_a_time_stamped_output_dir_is_new_to_each_launch_and_the_run_writes_there(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pipeline.output_dir=runs/${now:...}` is a time-stamped folder as Hydra's default is (resume-hunt). From the
    command line a second launch in the same second had its .hydra/ record in `runs/<time>_2` while the pipeline got
    the first run's `runs/<time>` (refused there as in use, or mixed into it); from a preset the stamp was resolved
    before the claim, so the second launch took the first run's folder as a named one."""
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.setattr(hydra.core.utils, "datetime", _Frozen)
    value = "runs/${now:%H-%M-%S}"
    arg = (
        f"pipeline.output_dir={value}"
        if where == "command line"
        else _preset(tmp_path, f"pipeline:\n  output_dir: {value}\n")
    )
    ran: list[tuple[Path, Path]] = []

    def run(cfg: Any) -> dict[str, Any]:
        ran.append((Path(HydraConfig.get().runtime.output_dir), tmp_path / cfg.pipeline.output_dir))
        return {}

    monkeypatch.setattr(cli, "run_job", run)
    for _ in range(2):
        monkeypatch.setattr(sys, "argv", ["roll-train", arg])
        cli.train_main()

    first = tmp_path / "runs" / "03-04-05"
    second = first.with_name("03-04-05_2")
    assert ran == [(first, first), (second, second)]
    assert (first / ".hydra").is_dir() and (second / ".hydra").is_dir()
