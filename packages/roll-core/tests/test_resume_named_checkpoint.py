"""`pipeline.resume_from=<run>/checkpoints/step_N` takes only a checkpoint `CheckpointManager.list()` takes.

A folder a crashed save left (`step_N.tmp`, which may hold state.json written before its rename and only part of a
rank's shards), a pruned one being deleted (`step_N.deleting`, its files going) or an earlier save of a step replaced
by a newer one was accepted as the checkpoint to resume from: the run loaded it (partially, or failed inside an
engine's load), and the rollback moved the run's complete newer checkpoints aside. Each is now a ConfigError naming
the complete checkpoints instead; a complete one (also `step_N.replaced` when it is its step's only copy) is taken.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_core.checkpoint import CheckpointManager
from roll_core.errors import ConfigError
from roll_core.pipelines.run_control import named_checkpoint, resolve_run_folder


def _save(m: CheckpointManager, step: int) -> Path:
    tmp = m.staging(step)
    (tmp / "weights").write_text(str(step))
    return m.commit(tmp, step, {})


@pytest.fixture
def run(tmp_path: Path) -> CheckpointManager:
    """A run with complete checkpoints 2 and 4, and what crashes left beside them."""
    m = CheckpointManager(tmp_path / "run", keep_last=5)
    _save(m, 2)
    _save(m, 4)
    # killed after its state.json, before the rename: the trainer's shards may be partial
    partial = m.staging(6)
    (partial / "state.json").write_text(json.dumps({"step": 6}))
    # a prune killed while deleting step 1's files (its state.json not deleted yet)
    (m.root / "step_000001.deleting").mkdir()
    (m.root / "step_000001.deleting" / "state.json").write_text(json.dumps({"step": 1}))
    # an earlier save of step 4 that a newer save of step 4 replaced (killed before it was deleted)
    (m.root / "step_000004.replaced").mkdir()
    (m.root / "step_000004.replaced" / "state.json").write_text(json.dumps({"step": 4}))
    return m


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("step_000006.tmp", "a save that did not finish"),
        ("step_000001.deleting", "being deleted"),
        ("step_000004.replaced", "replaced by step_000004"),
        ("step_000008", "no such folder"),
    ],
)
def test_a_folder_no_resume_would_pick_is_refused_naming_the_complete_ones(
    run: CheckpointManager, name: str, why: str
) -> None:
    folder = run.root / name
    for resolve in (
        lambda: named_checkpoint(str(folder)),
        lambda: resolve_run_folder(run.root.parent, False, str(folder), "x"),
    ):
        with pytest.raises(ConfigError) as info:
            resolve()
        msg = str(info.value)
        assert msg.startswith(f"pipeline.resume_from={folder}: not a complete checkpoint"), msg
        assert why in msg
        assert "step_000002, step_000004" in msg and f"pipeline.resume_from={run.root.parent}" in msg
    # nothing was moved or deleted: the run is as it was
    assert [p.name for p in run.list()] == ["step_000002", "step_000004"]


def test_complete_checkpoints_are_taken(run: CheckpointManager) -> None:
    for name in ("step_000002", "step_000004"):
        assert named_checkpoint(str(run.root / name)) == run.root / name
        assert resolve_run_folder(run.root.parent, False, str(run.root / name), "x") == run.root.parent
    # a run folder is not a checkpoint folder
    assert named_checkpoint(str(run.root.parent)) is None


def test_a_replaced_folder_that_is_its_steps_only_copy_is_taken(run: CheckpointManager) -> None:
    """A crash between a re-save's two renames leaves `step_N.replaced` as step N's only copy: list() takes it."""
    (run.root / "step_000004").rename(run.root / "step_000004.old")
    replaced = run.root / "step_000004.replaced"
    assert replaced in run.list()
    assert named_checkpoint(str(replaced)) == replaced


def test_a_checkpoint_a_rollback_set_aside_is_refused_saying_how_to_move_it_back(run: CheckpointManager) -> None:
    """A rollback (resume_from an earlier step) moves the newer checkpoints to `checkpoints/abandoned-*/`. Naming one
    of those was taken for a run folder and refused as "no complete checkpoint under .../step_N/checkpoints"; it now
    says it was set aside and how to resume from it."""
    from roll_core.pipelines.run_control import set_aside_newer

    moved = set_aside_newer(run.root / "step_000002")
    aside = next(p for p in moved if p.name == "step_000004")
    with pytest.raises(ConfigError, match=r"set aside when the run was rolled back .* move it back \(mv "):
        resolve_run_folder(run.root.parent, False, str(aside), "exp")


def test_a_users_copy_of_a_checkpoint_rolls_back_by_its_recorded_step(run: CheckpointManager, tmp_path: Path) -> None:
    """`pipeline.resume_from=<run>/checkpoints/best` (a user's copy of step 4, a name without a step) was read as
    step 0: the rollback moved every `step_N` aside, the older step 2 and the copied step 4 too, as "newer" (a fault
    before the next save then found no checkpoint to restart from). Only the run's checkpoints after its recorded step
    go now. A run folder holding nothing but such a copy was refused as having "no complete checkpoint"."""
    import shutil

    from roll_core.pipelines.run_control import set_aside_newer

    later = run.commit(run.staging(6), 6, {})  # (the staging call deletes the crashed save's step_000006.tmp)
    best = run.root / "best"
    shutil.copytree(run.root / "step_000004", best)
    assert resolve_run_folder(tmp_path / "x", False, str(best), "x") == run.root.parent
    moved = set_aside_newer(best)
    assert [p.name for p in moved] == [later.name]
    assert [p.name for p in run.list()] == ["step_000002", "step_000004"]

    alone = tmp_path / "copied" / "checkpoints" / "best"
    shutil.copytree(best, alone)
    assert resolve_run_folder(tmp_path / "x", False, str(alone), "x") == alone.parent.parent
    assert set_aside_newer(alone) == []
