"""The study of an Optuna sweep as roll follows it (roll_core.sweep_optuna.watch_sweep): roll-train
(roll_core.cli.train_main, in this process, the training run faked) runs hydra-optuna-sweeper on the basic launcher
and a real SIGTERM stops it mid-trial. The study is kept however the sweeper names it inside its `sweep()` (its
source recompiled with the local variable renamed, as a new release might), the wrappers are gone once the sweep
ends, and a sweeper whose shape roll cannot follow runs as before after one warning. The installed sweeper's shape
is pinned."""

from __future__ import annotations

import inspect
import re
import signal
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="install roll-core[sweep]")

with warnings.catch_warnings():  # Optuna 2.10 imports declarative_base from SQLAlchemy's 1.x place (deprecated)
    warnings.simplefilter("ignore", DeprecationWarning)
    import optuna
    from hydra_plugins.hydra_optuna_sweeper import _impl

from roll_core import cli, sweep_optuna
from roll_core.testing.sweeps import optuna_sweep_args, reset_sweep_state, root_logging_restored, summary_rows

pytestmark = pytest.mark.filterwarnings("ignore:.*declarative_base:DeprecationWarning")


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    reset_sweep_state(monkeypatch)  # the sweeps and failures are per process: every test starts from none
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh roll-train: the sweep gives it back
    try:
        with root_logging_restored():
            yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _sweeper_sweep(edit: Callable[[str], str], **names: Any) -> Any:
    """hydra-optuna-sweeper's own OptunaSweeperImpl.sweep, its source changed by `edit` and compiled in its module's
    globals (plus `names`): the sweeper as a release that changed only that would run."""
    source = textwrap.dedent(inspect.getsource(_impl.OptunaSweeperImpl.sweep))
    changed = edit(source)
    assert changed != source
    scope: dict[str, Any] = {}
    exec(compile(changed, _impl.__file__, "exec"), {**vars(_impl), **names}, scope)
    return scope["sweep"]


def _stopped_sweep(monkeypatch: pytest.MonkeyPatch, sweep_dir: Path) -> tuple[int, list[int]]:
    """roll-train: a 3-trial Optuna sweep; trial 0 finishes with accuracy 0.5, a real SIGTERM stops trial 1 mid-run
    (its GracefulStop, as the pipeline's loop), trial 2 is then not started. Returns the exit status and the jobs
    run."""
    import os

    from hydra.core.hydra_config import HydraConfig

    from roll_core.pipelines.run_control import GracefulStop

    ran: list[int] = []

    def run(cfg: Any) -> dict[str, Any]:
        ran.append(HydraConfig.get().job.num)
        if ran[-1] == 1:
            with GracefulStop() as graceful:
                os.kill(os.getpid(), signal.SIGTERM)
            return {"final_eval_accuracy": 0.1, "stopped_by_signal": graceful.signum}
        return {"final_eval_accuracy": 0.5, "stopped_by_signal": None}

    monkeypatch.setattr(cli, "run_job", run)
    monkeypatch.setattr(sys, "argv", ["roll-train", *optuna_sweep_args(sweep_dir, n_trials=3)])
    with pytest.raises(SystemExit) as exit_:
        cli.train_main()
    return int(exit_.value.code or 0), ran


def test_the_installed_sweeper_has_the_shape_roll_follows() -> None:
    """What watch_sweep relies on in the installed hydra-optuna-sweeper (OptunaSweeperImpl.sweep creates its study
    with optuna.create_study and numbers jobs from self.job_idx): a release that changes it fails here first."""
    assert sweeper_problem_of(_impl.OptunaSweeperImpl.sweep) is None


def sweeper_problem_of(sweep: Any) -> str | None:
    """sweeper_problem() with `sweep` as the installed OptunaSweeperImpl.sweep."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_impl.OptunaSweeperImpl, "sweep", sweep)
        return sweep_optuna.sweeper_problem()


def test_a_stopped_sweep_saves_its_best_result_whatever_the_sweeper_names_its_study(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """roll found the sweeper's study by its local variable's name (`study`) in stack frames: a sweeper that named
    it otherwise left a stopped sweep without optimization_results.yaml, silently. The study is now the one the
    sweeper's optuna.create_study returned: the best result so far is saved (trial 0's), and roll's wrappers are
    removed once the sweep ends."""
    renamed = _sweeper_sweep(lambda src: re.sub(r"\bstudy\b", "the_study", src))
    monkeypatch.setattr(_impl.OptunaSweeperImpl, "sweep", renamed)
    create_study = optuna.create_study
    sw = tmp_path / "sweep"

    code, ran = _stopped_sweep(monkeypatch, sw)

    assert code == 128 + signal.SIGTERM
    assert ran == [0, 1]
    rows = summary_rows(sw)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "stopped")]
    lr = float(rows[0]["overrides"].partition("=")[2])
    best = yaml.safe_load((sw / "optimization_results.yaml").read_text())
    assert best == {"name": "optuna", "best_params": {"algo.lr": lr}, "best_value": 0.5}
    assert _impl.OptunaSweeperImpl.__dict__["sweep"] is renamed  # the sweep's wrappers are gone
    assert optuna.create_study is create_study
    assert sweep_optuna.take_study(sw) is None  # handed over once, not kept


def test_a_sweeper_roll_cannot_follow_runs_after_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweeper whose sweep() calls create_study by a name bound at import (`from optuna import create_study`):
    no wrapper of roll's can see its study. The sweep starts with one warning saying so and what it costs, runs and
    stops as any other (summary, exit 128+15), and writes no optimization_results.yaml (the fail-safe)."""
    bound = _sweeper_sweep(
        lambda src: src.replace("optuna.create_study(", "create_study("), create_study=optuna.create_study
    )
    assert sweeper_problem_of(bound) == "OptunaSweeperImpl.sweep does not create its study with optuna.create_study"
    monkeypatch.setattr(_impl.OptunaSweeperImpl, "sweep", bound)
    sw = tmp_path / "sweep"

    code, ran = _stopped_sweep(monkeypatch, sw)

    assert code == 128 + signal.SIGTERM and ran == [0, 1]
    assert [(r["job"], r["status"]) for r in summary_rows(sw)] == [("0", "ok"), ("1", "stopped")]
    assert not (sw / "optimization_results.yaml").exists()
    out = capsys.readouterr()  # the job's logging (Hydra's) writes the roll logger to stdout
    warned = [line.partition("] ")[2] for line in (out.out + out.err).splitlines() if "cannot follow" in line]
    assert warned == [
        "roll cannot follow this hydra-optuna-sweeper's study (OptunaSweeperImpl.sweep does not create its study "
        "with optuna.create_study): a sweep a signal stops writes no optimization_results.yaml, and a study "
        "continued into a sweep folder that has its earlier jobs reuses their job numbers and folders"
    ]
    assert _impl.OptunaSweeperImpl.__dict__["sweep"] is bound
