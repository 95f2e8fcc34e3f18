"""`pipeline.resume_from=<folder>` that names no run says what was meant (roll_core.checkpoint.not_a_run_hint).

Pointed at a run's `checkpoints/` folder, inside a checkpoint (its `actor/` or `actor/model`), at a folder that does
not exist or at a run whose only save did not finish, the error named `<folder>/checkpoints`, a folder that never
existed ("no complete checkpoint under <run>/checkpoints/checkpoints"), and nothing of what to do. It now keeps that
message and says why, with the value that resumes (the run folder, the checkpoint) or starts a new run from its
weights (`model.path`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.checkpoint import CheckpointManager
from roll_core.errors import ConfigError
from roll_core.pipelines.run_control import resolve_run_folder


@pytest.fixture
def run(tmp_path: Path) -> CheckpointManager:
    """A run with complete checkpoints 1 and 2, each with an actor's HF folder."""
    m = CheckpointManager(tmp_path / "run", keep_last=5)
    for step in (1, 2):
        tmp = m.staging(step)
        (tmp / "actor" / "model").mkdir(parents=True)
        m.commit(tmp, step, {})
    return m


def _refusal(resume_from: Path, tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as refused:
        resolve_run_folder(tmp_path / "new", False, str(resume_from), "exp")
    message = str(refused.value)
    assert message.startswith(f"pipeline.resume_from={resume_from}: no complete checkpoint under ")
    return message


def test_the_checkpoints_folder_names_the_run_and_its_latest(run: CheckpointManager, tmp_path: Path) -> None:
    message = _refusal(run.root, tmp_path)
    latest = run.root / "step_000002"
    assert f"it is the checkpoints/ folder of the run {run.root.parent}" in message
    assert f"pipeline.resume_from={run.root.parent} continues it from its latest checkpoint (step_000002)" in message
    assert f"pipeline.resume_from={latest} from that one" in message


@pytest.mark.parametrize("inner", ["actor", "actor/model"])
def test_a_folder_inside_a_checkpoint_names_the_checkpoint(run: CheckpointManager, tmp_path: Path, inner: str) -> None:
    checkpoint = run.root / "step_000001"
    message = _refusal(checkpoint / inner, tmp_path)
    assert f"it lies inside the checkpoint {checkpoint}: pipeline.resume_from={checkpoint} resumes" in message
    assert f"model.path={checkpoint / 'actor' / 'model'}" in message


def test_a_missing_folder_says_so(tmp_path: Path) -> None:
    assert _refusal(tmp_path / "typo", tmp_path).endswith("(no such folder)")


def test_a_run_whose_only_save_did_not_finish_says_so(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path / "killed")
    m.staging(3)  # a save killed before its rename
    assert _refusal(m.root.parent, tmp_path).endswith("(only a save that did not finish: step_000003.tmp)")


def test_a_checkpoints_folder_whose_only_save_did_not_finish_says_so(tmp_path: Path) -> None:
    """It said "no checkpoints/step_N folder with a state.json", looking for a checkpoints/ inside checkpoints/."""
    m = CheckpointManager(tmp_path / "killed")
    m.staging(3)
    assert _refusal(m.root, tmp_path).endswith("(only a save that did not finish: step_000003.tmp)")


def test_a_run_folder_and_a_step_folder_are_still_taken(run: CheckpointManager, tmp_path: Path) -> None:
    assert resolve_run_folder(tmp_path / "new", False, str(run.root.parent), "exp") == run.root.parent
    step = run.root / "step_000001"
    assert resolve_run_folder(tmp_path / "new", False, str(step), "exp") == run.root.parent
