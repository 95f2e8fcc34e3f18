"""An Optuna sweep with a storage but no study name (roll_core.sweep_optuna.prepare_study_storage): Optuna's
`load_if_exists` needs a name, so each such sweep made a new "no-name-<uuid>" study and continued none, silently; now
one warning says so and names the setting. A named study is continued, and gets no warning."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # optuna_sweeps, shared by the Optuna sweep tests
from optuna_sweeps import OPTUNA_SWEEPER, SQLALCHEMY_1_WARNINGS, optuna

from roll_core.sweep_optuna import prepare_study_storage

pytestmark = SQLALCHEMY_1_WARNINGS


def _create(url: str, name: str | None) -> optuna.Study:
    """The study hydra-optuna-sweeper 1.3 opens for a sweep (its `optuna.create_study` call)."""
    return optuna.create_study(study_name=name, storage=url, directions=["maximize"], load_if_exists=True)


@pytest.mark.parametrize("name", [None, ""], ids=["null", "empty"])
def test_a_storage_without_a_study_name_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str | None
) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with caplog.at_level(logging.WARNING, logger="roll"):
        prepare_study_storage({"_target_": OPTUNA_SWEEPER, "storage": url, "study_name": name})
    warned = [r.getMessage() for r in caplog.records if "without hydra.sweeper.study_name" in r.getMessage()]
    assert len(warned) == 1 and url in warned[0] and "continues none" in warned[0], caplog.text
    # What the warning is about: two sweeps, two unrelated studies.
    assert _create(url, name or None).study_name != _create(url, name or None).study_name


def test_a_named_study_is_continued_without_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with caplog.at_level(logging.WARNING, logger="roll"):
        prepare_study_storage({"_target_": OPTUNA_SWEEPER, "storage": url, "study_name": "lr"})
    assert not caplog.records, caplog.text
    first = _create(url, "lr")
    first.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=1)
    assert len(_create(url, "lr").trials) == 1  # the second sweep's study is the first one's
