"""Checkpoints under failure: what crashed saves leave is cleaned up, a save that fails (a full disk) leaves the
earlier checkpoints intact and says so, a rollback sets aside every newer checkpoint whatever its number of digits.
(The atomic write, the fsyncs and the killed prune: test_registry_and_data.py; real kills: tests/e2e.)"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.checkpoint import CheckpointError, CheckpointManager
from roll_core.cluster.group import WorkerDiedError
from roll_core.pipelines.loop import Pipeline
from roll_core.pipelines.run_control import set_aside_newer


def _save(m: CheckpointManager, step: int, text: str | None = None) -> Path:
    tmp = m.staging(step)
    (tmp / "weights").write_text(text or str(step))
    return m.commit(tmp, step, {})


def test_what_crashed_saves_left_is_deleted_before_the_next_save_writes(tmp_path: Path) -> None:
    """A save killed mid-write leaves `step_N.tmp`; when no later save is of step N (a stop's save at an odd step,
    a changed save_every, a second Ctrl-C) it stayed forever, checkpoint-sized, on a disk that may be filling up."""
    m = CheckpointManager(tmp_path, keep_last=5)
    _save(m, 2)
    _save(m, 4)
    (m.root / "step_000007.tmp").mkdir()  # killed while saving step 7 (a stop's save)
    (m.root / "step_000007.tmp" / "weights").write_bytes(b"x" * 1000)
    (m.root / "step_000001.deleting").mkdir()  # killed while pruning
    shutil.copytree(m.root / "step_000004", m.root / "step_000004.replaced")  # killed after the second rename
    (m.root / "abandoned-x").mkdir()  # a rollback's set-aside checkpoints are the user's: kept
    tmp = m.staging(6)
    assert sorted(p.name for p in m.root.iterdir()) == [
        "abandoned-x",
        "step_000002",
        "step_000004",
        "step_000006.tmp",
    ]
    (tmp / "weights").write_text("6")
    m.commit(tmp, 6, {})
    assert [p.name for p in m.list()] == ["step_000002", "step_000004", "step_000006"]


def test_the_only_copy_of_a_step_survives_a_resave_that_fails_before_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash between the renames of a save left `step_N.replaced` as step N's only complete folder; saving step
    N again deleted it before the new folder was in place, so a second failure there lost step N."""
    m = CheckpointManager(tmp_path, keep_last=3)
    _save(m, 1)
    _save(m, 2, "old 2")
    (m.root / "step_000002").rename(m.root / "step_000002.replaced")  # what the first crash left
    tmp = m.staging(2)
    (tmp / "weights").write_text("new 2")
    real_rename = Path.rename

    def failing(self: Path, target: Path) -> Path:
        if self.name.endswith(".tmp"):
            raise OSError(errno.EIO, "Input/output error")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError):
        m.commit(tmp, 2, {})
    monkeypatch.setattr(Path, "rename", real_rename)
    assert [p.name for p in m.list()] == ["step_000001", "step_000002.replaced"]
    assert (m.latest() / "weights").read_text() == "old 2"
    _save(m, 2, "new 2")  # and the next save of the step replaces it
    assert sorted(p.name for p in m.root.iterdir()) == ["step_000001", "step_000002"]
    assert (m.latest() / "weights").read_text() == "new 2"


class _Trainer:
    """Writes part of a checkpoint, then fails as `error` says."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def save(self, folder: Path, tokenizer: str) -> dict[str, Any]:
        (folder / "actor").mkdir()
        (folder / "actor" / "model.safetensors").write_bytes(b"half of the weights")
        raise self.error


def _pipeline(tmp_path: Path, error: BaseException) -> Any:
    """What `Pipeline.save` uses of a pipeline: its checkpoints (step 2 saved), trainer, collector, config and
    tracker."""
    from roll_core.tracking import Tracker

    ckpt = CheckpointManager(tmp_path, keep_last=1)
    _save(ckpt, 2)
    return SimpleNamespace(
        ckpt=ckpt,
        tracker=Tracker(tmp_path.parent / f"{tmp_path.name}-run", trackers=()),
        trainer=_Trainer(error),
        collector=SimpleNamespace(state_dict=dict),
        cfg=SimpleNamespace(model=SimpleNamespace(tokenizer=None), experiment="x"),
        model_path="m",
        wall_seconds=lambda: 1.0,
    )


def test_a_save_on_a_full_disk_deletes_its_partial_folder_and_names_the_intact_checkpoint(tmp_path: Path) -> None:
    """The partial folder held the space the next try (and the user's cleanup) needed, and the error was a bare
    OSError from inside an engine's writer."""
    p = _pipeline(tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointError) as info:
        Pipeline.save(p, 4)
    msg = str(info.value)
    assert msg.startswith("step 4: the checkpoint could not be written (OSError: [Errno 28] No space left on device)")
    assert f"the latest complete checkpoint, {p.ckpt.root / 'step_000002'}, is intact" in msg
    assert "The disk is full" in msg and isinstance(info.value.__cause__, OSError)
    assert sorted(x.name for x in p.ckpt.root.iterdir()) == ["step_000002"]
    assert (p.ckpt.latest() / "weights").read_text() == "2"


def test_the_metric_records_reach_the_disk_before_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """metrics.jsonl was never forced to disk while checkpoints are: after a power cut a checkpoint of step N could
    survive the records of the steps before it, which the resumed run does not redo (missing steps)."""
    import os

    p = _pipeline(tmp_path / "ckpt", OSError(errno.EIO, "Input/output error"))
    p.tracker.log(3, {"reward/mean": 0.5})
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    with pytest.raises(CheckpointError):
        Pipeline.save(p, 4)
    assert synced and synced[0] == str(p.tracker.metrics_path)


def test_a_worker_death_or_a_second_ctrl_c_during_a_save_is_raised_as_it_is(tmp_path: Path) -> None:
    """A fault stays a fault (run_control restarts the run from the intact checkpoint); an interrupt stays one."""
    for error in (WorkerDiedError("actor_train rank 0 died during save()"), KeyboardInterrupt()):
        p = _pipeline(tmp_path / type(error).__name__, error)
        with pytest.raises(type(error)):
            Pipeline.save(p, 4)
        assert sorted(x.name for x in p.ckpt.root.iterdir()) == ["step_000002"]


def test_a_rollback_sets_aside_newer_checkpoints_past_six_digits(tmp_path: Path) -> None:
    """Folder names were compared as text: `step_1000000` < `step_999999`, so rolling back to step 999999 left
    step 1000000 in place and `latest()` (the next restart's checkpoint) went back to it."""
    m = CheckpointManager(tmp_path, keep_last=5)
    for step in (999_998, 999_999, 1_000_000):
        _save(m, step)
    moved = set_aside_newer(m.root / "step_999999")
    assert [p.name for p in moved] == ["step_1000000"]
    assert m.latest() == m.root / "step_999999"


def _fsync_failing_on(monkeypatch: pytest.MonkeyPatch, folder: Path, code: int) -> None:
    """os.fsync fails with `code` for `folder` (a directory) from now on."""
    import os

    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(folder):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_write_error_flushing_the_rename_fails_the_save_and_prunes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every error of a folder's fsync was swallowed: an EIO (or a network filesystem's full disk) flushing the
    rename let the save go on as durable and prune the older checkpoints, so a crash then could leave none. A
    filesystem that merely refuses to flush folders (EINVAL) still saves."""
    m = CheckpointManager(tmp_path, keep_last=1)
    _save(m, 2)
    _fsync_failing_on(monkeypatch, m.root, errno.EIO)
    with pytest.raises(OSError, match="Input/output error"):
        _save(m, 4)
    assert [p.name for p in m.list()] == ["step_000002"]  # step 2 kept; 4, maybe not on disk, taken back (below)
    _fsync_failing_on(monkeypatch, m.root, errno.EINVAL)
    _save(m, 6)
    assert [p.name for p in m.list()] == ["step_000006"]


def test_a_write_error_flushing_a_checkpoint_folder_stops_it_before_it_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder inside the checkpoint whose entries did not reach the disk (fsync EIO), or that could not be read
    to flush its files, was skipped: the checkpoint was renamed into place as complete."""
    import os

    m = CheckpointManager(tmp_path, keep_last=2)
    _save(m, 2)
    tmp = m.staging(4)
    (tmp / "actor" / "model").mkdir(parents=True)
    (tmp / "actor" / "model" / "model.safetensors").write_bytes(b"weights")
    _fsync_failing_on(monkeypatch, tmp / "actor" / "model", errno.EIO)
    with pytest.raises(OSError, match="Input/output error"):
        m.commit(tmp, 4, {})
    assert [p.name for p in m.list()] == ["step_000002"]
    monkeypatch.undo()

    real_scandir = os.scandir

    def unreadable(path: Any = ".", *a: Any, **k: Any) -> Any:
        if str(path) == str(tmp / "actor"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path, *a, **k)

    monkeypatch.setattr(os, "scandir", unreadable)
    with pytest.raises(PermissionError):
        m.commit(tmp, 4, {})
    assert [p.name for p in m.list()] == ["step_000002"]


def test_the_first_save_flushes_the_new_checkpoints_folder_into_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first save creates `checkpoints/`; its entry in the run folder was never flushed, so a power cut could
    lose the folder, with every checkpoint in it, though each was flushed."""
    import os

    run = tmp_path / "run"
    run.mkdir()
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    m = CheckpointManager(run)
    _save(m, 1)
    assert synced.index(str(run)) > synced.index(str(m.root))  # after the rename's flush


class _Saved:
    """A trainer whose save writes its files and succeeds."""

    def save(self, folder: Path, tokenizer: str) -> dict[str, Any]:
        (folder / "weights").write_text("4")
        return {}


def test_a_save_whose_rename_did_not_reach_the_disk_names_the_checkpoint_that_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flush of the rename failed (EIO) after the new folder had its final name: `latest()` then listed it, and
    the failure said "its partial folder was deleted and the latest complete checkpoint, step_000004, is intact"
    of a folder neither deleted nor known on disk. It is taken back and deleted; step 2 is named. A step saved again
    gets its old folder back."""
    p = _pipeline(tmp_path, OSError(errno.EIO, "unused"))
    p.trainer = _Saved()
    _fsync_failing_on(monkeypatch, p.ckpt.root, errno.EIO)
    with pytest.raises(CheckpointError) as info:
        Pipeline.save(p, 4)
    msg = str(info.value)
    assert msg.startswith("step 4: the checkpoint could not be written (OSError: [Errno 5] Input/output error)")
    assert f"the latest complete checkpoint, {p.ckpt.root / 'step_000002'}, is intact" in msg
    assert sorted(x.name for x in p.ckpt.root.iterdir()) == ["step_000002"]

    with pytest.raises(CheckpointError) as info:
        Pipeline.save(p, 2)  # a rollback's redo of step 2: the old step 2 stays the one listed
    assert f"the latest complete checkpoint, {p.ckpt.root / 'step_000002'}, is intact" in str(info.value)
    assert sorted(x.name for x in p.ckpt.root.iterdir()) == ["step_000002"]
    assert (p.ckpt.latest() / "weights").read_text() == "2"


def test_a_new_checkpoint_that_cannot_be_taken_back_is_named_in_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the flush of the rename and then its undo fail, the error says the new folder may not be on disk."""
    m = CheckpointManager(tmp_path, keep_last=1)
    _save(m, 2)
    _fsync_failing_on(monkeypatch, m.root, errno.EIO)
    real = Path.rename

    def rename(self: Path, target: Any) -> Any:
        if self.name == "step_000004":  # the undo's
            raise OSError(errno.EROFS, "Read-only file system")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError) as info:
        _save(m, 4)
    assert str(info.value) == (
        f"[Errno 5] Input/output error; {m.root / 'step_000004'} may not be on disk, and taking it back failed "
        "([Errno 30] Read-only file system)"
    )
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
    # The run's message does not call the folder intact, nor say it was deleted (it named it the checkpoint to resume)
    from roll_core.pipelines._run_endings import save_failure

    message = save_failure(4, info.value, m.latest())
    assert f"{m.root / 'step_000004'} is listed as the latest checkpoint but may not be on disk" in message
    assert "intact" not in message and "deleted" not in message
