"""What roll-train's Optuna sweep optimises and asks (roll_core.sweep_optuna): roll-train (roll_core.cli.train_main,
in this process, the training run faked) refuses a direction other than `maximize` before any trial (each job
returns its final held-out accuracy; hydra-optuna-sweeper's default is `minimize`), and a study continued from its
storage with a seeded sampler asks new values, not the earlier sweep's again."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # optuna_sweeps, shared by the Optuna sweep tests
from omegaconf import OmegaConf
from optuna_sweeps import OPTUNA_SWEEPER, SQLALCHEMY_1_WARNINGS, Direction, optuna

from roll_core.sweep_optuna import continued_seed, direction_problem, prepare_study_storage, reseed_continued
from roll_core.testing.sweeps import optuna_sweep_args, summary_rows

# the sweeps and failures are per process: every test starts from none
pytestmark = [*SQLALCHEMY_1_WARNINGS, pytest.mark.usefixtures("fresh_sweep_state")]


def test_a_sweep_left_at_the_sweepers_default_direction_is_refused_before_any_trial(
    tmp_path: Path, roll_train: Callable[..., int], lr_scored_job: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`roll-train -m hydra/sweeper=optuna algo.lr=interval(...)` minimised the final held-out accuracy (the
    sweeper's default direction): 3 trials ran and optimization_results.yaml named the lowest accuracy (0.196 of
    0.196, 0.786, 0.806) the best. Now it exits 2 naming hydra.sweeper.direction=maximize, with no trial run."""
    sw = tmp_path / "sweep"
    args = [a for a in optuna_sweep_args(sw, 3) if not a.startswith("hydra.sweeper.direction=")]
    ran: list[float] = []

    code = roll_train(*args, job=lr_scored_job(ran))

    assert (code, ran) == (2, [])
    err = capsys.readouterr().err
    assert "hydra.sweeper.direction=minimize" in err and "Set hydra.sweeper.direction=maximize" in err
    assert not (sw / "optimization_results.yaml").exists()
    assert not (sw / "0").exists()


@pytest.mark.parametrize(
    ("direction", "refused"),
    [
        ("maximize", None),
        (Direction.maximize, None),
        (["maximize"], None),
        ("minimize", "hydra.sweeper.direction=minimize"),
        (Direction.minimize, "hydra.sweeper.direction=minimize"),
        (OmegaConf.create(["maximize", "minimize"]), "hydra.sweeper.direction=[maximize,minimize]"),
    ],
)
def test_only_maximize_is_a_direction_for_the_accuracy_jobs_return(direction: Any, refused: str | None) -> None:
    """Each job returns one value, its accuracy: `minimize` searches for the worst settings and several
    objectives fail every trial (one value is not a list)."""
    problem = direction_problem(direction)
    assert (problem is None) == (refused is None)
    if refused is not None:
        assert problem is not None and problem.startswith(f"{refused}: ")


def test_a_continued_study_with_a_seeded_sampler_asks_new_values(
    tmp_path: Path, roll_train: Callable[..., int], lr_scored_job: Any
) -> None:
    """A sweep continuing a study (same storage and study name) with `hydra.sweeper.sampler.seed=0` asked exactly
    the lr the study's first trial, asked under the same seed, had (its sampler restarted the seed's random stream):
    the trial ran twice. Now the continued study's sampler draws from a seed made of the seed and the trial count."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    prepare_study_storage(OmegaConf.create({"_target_": OPTUNA_SWEEPER, "storage": storage, "study_name": "roll"}))
    # the earlier sweep's trial, as its sweeper asked it (TPE seeded 0, the interval's distribution)
    study = optuna.create_study(
        study_name="roll", storage=storage, sampler=optuna.samplers.TPESampler(seed=0), direction="maximize"
    )
    first = study.ask()
    earlier = first.suggest_float("algo.lr", 1e-6, 1e-5)
    study.tell(first, 0.5)
    ran: list[float] = []

    more = (f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=roll")
    assert roll_train(*optuna_sweep_args(tmp_path / "sweep", 1, 1, *more), job=lr_scored_job(ran)) == 0

    assert len(ran) == 1 and ran[0] != earlier, (earlier, ran)
    assert [r["job"] for r in summary_rows(tmp_path / "sweep")] == ["1"]
    trials = optuna.load_study(study_name="roll", storage=storage).trials
    assert [(t.params["algo.lr"], t.value) for t in trials] == [(earlier, 0.5), (ran[0], ran[0] * 1e5)]


def test_the_continued_seed_is_reproducible_and_its_own() -> None:
    """reseed_continued: the same seed and trial count give the same sampler stream (a rerun of the continuation
    asks the same values), another count or no earlier trial differ; a sampler without a seed is left alone."""
    cfg = OmegaConf.create({"_target_": "optuna.samplers.RandomSampler", "seed": 0})

    def asks(done: int) -> list[float]:
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        assert reseed_continued(study, cfg, done) == (done > 0)
        return [study.ask().suggest_float("x", 0.0, 1.0) for _ in range(3)]

    assert asks(2) == asks(2)
    assert len({tuple(asks(0)), tuple(asks(2)), tuple(asks(3))}) == 3
    assert continued_seed(0, 2) not in (0, continued_seed(0, 3), continued_seed(1, 2))
    unseeded = OmegaConf.create({"_target_": "optuna.samplers.RandomSampler", "seed": None})
    study = optuna.create_study()
    sampler = study.sampler
    assert not reseed_continued(study, unseeded, 5) and study.sampler is sampler
