"""A checkpoint save that fails inside torch's distributed checkpoint (the optimizer's DCP shards on a full disk)
ends the run with roll's one-line `CheckpointError`, like any other failed save: torch raises a
`CheckpointException`, which is a BaseException whose text is every rank's traceback, and whose zip writer reports
a full disk as "unexpected pos N vs M" without ENOSPC. (Other save failures: test_checkpoint_failures.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from roll_core.checkpoint import CheckpointError, CheckpointManager
from roll_core.pipelines import _run_endings
from roll_core.pipelines.loop import Pipeline

ZIP_ERROR = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def _dcp_failure() -> CheckpointException:
    """What `dcp.save` raised on a 600 KiB tmpfs (roll-train's optimizer save), with its rank's stack."""
    try:
        raise RuntimeError(ZIP_ERROR)
    except RuntimeError as inner:
        wrapped = _wrap_exception(inner)
    return CheckpointException("CheckpointException", {0: wrapped})


class _Trainer:
    def save(self, folder: Path, tokenizer: str) -> dict[str, Any]:
        (folder / "actor").mkdir()
        (folder / "actor" / "model.safetensors").write_bytes(b"the weights, before the optimizer failed")
        raise _dcp_failure()


def _pipeline(tmp_path: Path) -> Any:
    """What `Pipeline.save` uses of a pipeline: its checkpoints (step 2 saved), trainer, collector, config, tracker."""
    from roll_core.tracking import Tracker

    ckpt = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=1)
    tmp = ckpt.staging(2)
    (tmp / "weights").write_text("2")
    ckpt.commit(tmp, 2, {})
    return SimpleNamespace(
        ckpt=ckpt,
        tracker=Tracker(tmp_path / "run", trackers=()),
        trainer=_Trainer(),
        collector=SimpleNamespace(state_dict=dict),
        cfg=SimpleNamespace(model=SimpleNamespace(tokenizer=None), experiment="x"),
        model_path="m",
        wall_seconds=lambda: 1.0,
    )


def _usage(free: int) -> Any:
    return lambda path: shutil._ntuple_diskusage(600 * 1024, 600 * 1024 - free, free)  # type: ignore[attr-defined]


def test_a_dcp_save_on_a_full_disk_is_a_one_line_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was torch's traceback (exit 1, no "roll-train: run stopped", no word of the disk): the BaseException
    passed roll's `except Exception`-only wrapping."""
    p = _pipeline(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", _usage(400))  # the write ran out of room
    with pytest.raises(CheckpointError) as info:
        Pipeline.save(p, 4)
    msg = str(info.value)
    assert msg.startswith(
        f"step 4: the checkpoint could not be written (CheckpointException: rank 0: RuntimeError: {ZIP_ERROR})"
    )
    assert "Traceback" not in msg and "\n" not in msg
    assert f"the latest complete checkpoint, {p.ckpt.root / 'step_000002'}, is intact" in msg
    assert msg.endswith("The disk is full: free space (or lower pipeline.keep_last) before resuming.")
    assert sorted(x.name for x in p.ckpt.root.iterdir()) == ["step_000002"]  # the partial folder is gone


def test_the_full_disk_hint_needs_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same error with room to spare on the disk is not called a full disk."""
    p = _pipeline(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", _usage(_run_endings.FULL_BELOW * 4))
    with pytest.raises(CheckpointError) as info:
        Pipeline.save(p, 4)
    assert "The disk is full" not in str(info.value)
    assert str(info.value).endswith("pipeline.resume=true continues from it.")


def test_free_bytes_reads_the_nearest_existing_folder(tmp_path: Path) -> None:
    """The staging folder may not exist yet (or any more): its disk is its nearest existing parent's."""
    assert _run_endings.free_bytes(tmp_path / "not" / "yet") == shutil.disk_usage(tmp_path).free
