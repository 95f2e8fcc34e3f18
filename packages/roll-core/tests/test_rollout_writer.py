"""RolloutWriter's durability (roll_core.posttrain.writer): a step's rows are on disk when `write` returns, the
names of the files holding them included (the resume rule and the layouts are tested in tests/e2e/test_rollout_only)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from roll_core.posttrain import writer as writer_mod
from roll_core.posttrain.writer import ROW_FIELDS, RolloutWriter, read_rollout


def _row(i: int) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(
        prompt_id=f"p{i}",
        prompt="q",
        answer="a",
        prompt_ids=[1, 2],
        response="x",
        response_ids=[3],
        response_logprobs=[-0.5],
        reward=0.25 * i,
        correct=False,
        formatted=True,
        finish_reason="stop",
        metadata={},
        sample=0,
        shard=0,
    )
    return row


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet"])
def test_a_written_step_has_its_folder_entry_synced(tmp_path: Path, monkeypatch, name: str) -> None:
    """A Parquet part is renamed into the folder (a JSONL file created in it): without an fsync of the folder the
    new name could be lost by a crash after the next checkpoint, which lists it, and the run could not resume."""
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    synced: list[int] = []  # inodes of the folders fsync'd
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            synced.append(st.st_ino)
        real(fd)

    monkeypatch.setattr(writer_mod.os, "fsync", fsync)
    path = tmp_path / name
    w = RolloutWriter(path)
    w.start(resume=False)
    w.write(1, [_row(0), _row(1)])
    folder = path if name.endswith(".parquet") else tmp_path
    assert os.stat(folder).st_ino in synced
    w.write(2, [_row(2)])
    assert [r["prompt_id"] for r in read_rollout(path)] == ["p0", "p1", "p2"]
