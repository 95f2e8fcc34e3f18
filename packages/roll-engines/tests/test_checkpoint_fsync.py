"""A train engine's `save` returns only once every file it wrote is flushed to disk by its own process: on a shared
filesystem the driver's flush of the checkpoint (roll_core.checkpoint) does not reach what other nodes wrote
(roll_engines.train._hf_checkpoint.fsync_written). `os.fsync` is recorded (the path of the descriptor, and the
file's size then: a flush before the last write would not count) while a tiny engine saves in this process;
Megatron's forked writer processes flush in their own processes, which this test does not see, by design."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd (Linux)")


@pytest.fixture
def flushed(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Real path -> its size when this process last fsync'ed it (folders too), while the test runs."""
    seen: dict[str, int] = {}
    real = os.fsync

    def recording(fd: int) -> None:
        real(fd)
        seen[os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))] = os.fstat(fd).st_size

    monkeypatch.setattr(os, "fsync", recording)
    yield seen


def _unflushed(root: Path, flushed: dict[str, int]) -> list[str]:
    """Files (at their final size) and folders under `root`, and `root` itself, that were not flushed."""
    paths = [root, *root.rglob("*")]
    missing = []
    for p in paths:
        real = os.path.realpath(p)
        if real not in flushed or (p.is_file() and flushed[real] != p.stat().st_size):
            missing.append(str(p.relative_to(root.parent)))
    return sorted(missing)


def test_hf_save_flushes_every_file_it_wrote(tiny: str, tmp_path: Path, flushed: dict[str, int]) -> None:
    """The single-process hf engine (rank 0: it writes model/, optimizer/ and engine.pt) flushes all of it,
    and the folders, before `save` returns."""
    from roll_engines.train.hf import HFTrainEngine

    engine = HFTrainEngine(tiny, lr=1e-2)
    engine.save(tmp_path / "ckpt", tiny)
    written = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert {"model", "optimizer", "engine.pt"} <= {p.relative_to(tmp_path / "ckpt").parts[0] for p in written}
    assert _unflushed(tmp_path / "ckpt", flushed) == []
    assert os.path.realpath(tmp_path) in flushed  # ckpt/'s own entry, in the folder it was created in


def _tree(root: Path) -> None:
    """What a two-rank save leaves: rank 0's files, each rank's DCP shard, Megatron's group-prefixed shards."""
    for name in (
        "model/model.safetensors",
        "model/config.json",
        "engine.pt",
        "optimizer/.metadata",
        "optimizer/__0_0.distcp",
        "optimizer/__1_0.distcp",
        "optimizer/__10_0.distcp",
        "optimizer/__1.metadata",
        "optimizer/expert__1_0.distcp",
        "optimizer/expert__0_0.distcp",
    ):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")


def test_each_rank_flushes_its_own_files_only(tmp_path: Path, flushed: dict[str, int]) -> None:
    """A rank flushes the shards named after it; the coordinator everything but the other ranks' shards (a
    rank flushing every rank's shards would cost ranks x shards flushes, and flush nothing it owns)."""
    from roll_engines.train._hf_checkpoint import fsync_written

    _tree(tmp_path / "ckpt")

    def files() -> set[str]:
        found = {Path(p).relative_to(tmp_path / "ckpt") for p in flushed if Path(p).is_file()}
        flushed.clear()
        return {str(p) for p in found}

    fsync_written(tmp_path / "ckpt" / "optimizer", rank=1, coordinator=False)
    assert files() == {"optimizer/__1_0.distcp", "optimizer/__1.metadata", "optimizer/expert__1_0.distcp"}
    fsync_written(tmp_path / "ckpt", rank=0, coordinator=True)
    assert files() == {
        "model/model.safetensors",
        "model/config.json",
        "engine.pt",
        "optimizer/.metadata",
        "optimizer/__0_0.distcp",
        "optimizer/expert__0_0.distcp",
    }


def test_megatron_save_flushes_its_distributed_checkpoint(
    tiny: str, tmp_path: Path, flushed: dict[str, int], megatron_process_group: None
) -> None:
    """The Megatron engine's optimizer/ (a dist_checkpointing save whose shards forked writer processes wrote,
    and whose metadata rank 0 wrote) is flushed by the rank itself before `save` returns."""
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.megatron import MegatronTrainEngine

    engine = MegatronTrainEngine(tiny, dist_backend="gloo", micro_batch_size=3, lr=1e-2)
    engine.train_step(toy_batch(tiny), PolicyObjective())  # the distributed optimizer saves only a stepped state
    engine.save(tmp_path / "ckpt", tiny)
    optimizer = tmp_path / "ckpt" / "optimizer"
    assert any(p.suffix == ".distcp" for p in optimizer.iterdir()) and (optimizer / "metadata.json").is_file()
    assert _unflushed(optimizer, flushed) == []
    # model/ is written by the engine's save itself (megatron/_weights.py, rank 0), which flushes it too.
    assert _unflushed(tmp_path / "ckpt" / "model", flushed) == []
