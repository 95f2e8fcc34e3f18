"""A checkpoint that records no config (an older roll's) resumed by a run that loads fewer critics than it holds
warns, naming the critic folders that are dropped (roll_core.config.resume.check_checkpoint).

With a recorded config algo.adv_estimator and algo.num_critics are fixed and such a resume is refused; without one
nothing is compared, and a PPO checkpoint resumed as GRPO dropped its trained critic with only the INFO line "records
no config: the settings were not compared" (the trainer loads only the critics its own config has).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from roll_core.checkpoint import CheckpointManager
from roll_core.config import load_config
from roll_core.config.resume import check_checkpoint


def _older_checkpoint(tmp_path: Path, *roles: str) -> Path:
    """A complete checkpoint holding `roles` folders and no config.yaml (saved by an older roll)."""
    manager = CheckpointManager(tmp_path / "run", keep_last=1)
    staged = manager.staging(3)
    for role in roles:
        (staged / role / "model").mkdir(parents=True)
    folder = manager.commit(staged, 3, {})
    (folder / "config.yaml").unlink(missing_ok=True)
    return folder


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("roll")]


@pytest.mark.parametrize(
    ("held", "overrides", "dropped"),
    [
        (("actor", "critic"), ["algo=grpo"], "critic/"),  # PPO resumed as GRPO
        (
            ("actor", "critic", "critic_1", "critic_2"),
            ["algo=ppo", "algo.group_size=2", "algo.num_critics=2"],
            "critic_2/",
        ),
    ],
)
def test_critics_a_run_does_not_load_are_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, held: tuple[str, ...], overrides: list[str], dropped: str
) -> None:
    folder = _older_checkpoint(tmp_path, *held)
    with caplog.at_level(logging.INFO):
        lines = check_checkpoint(folder, load_config(["model=tiny", *overrides]))
    assert len(lines) == 1 and "records no config" in lines[0]
    (warning,) = _warnings(caplog)
    assert f"{folder} records no config (saved by an older roll) and holds {dropped}, which this run" in warning
    assert "dropped" in warning and "algo.adv_estimator=gae" in warning


def test_a_run_that_loads_every_critic_is_not_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = _older_checkpoint(tmp_path, "actor", "critic")
    with caplog.at_level(logging.INFO):
        check_checkpoint(folder, load_config(["model=tiny", "algo=ppo"]))
        check_checkpoint(_older_checkpoint(tmp_path / "grpo", "actor"), load_config(["model=tiny"]))
    assert _warnings(caplog) == []
