"""A truncated *.safetensors file raised safetensors' bare "Error while deserializing header: ..." naming no file:
a resume from a checkpoint whose write was cut short did not say which file of which folder was broken. Now the same
exception type (SafetensorError, which callers catch) names the file and says the folder is incomplete or corrupt
(roll_engines.train._safetensors_file), at the hf engine's checkpoint load as at the megatron engine's
(test_megatron_atomic_load.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file


def _truncated(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def test_a_truncated_file_is_named_with_the_same_exception_type(tmp_path: Path) -> None:
    from roll_engines.train._safetensors_file import read_safetensors, read_safetensors_folder

    whole = tmp_path / "whole.safetensors"
    save_file({"a": torch.arange(64.0), "b": torch.ones(3, 5)}, whole)
    assert torch.equal(read_safetensors(whole)["a"], torch.arange(64.0))
    (tmp_path / "broken").mkdir()
    broken = tmp_path / "broken" / "model.safetensors"
    shutil.copy(whole, broken)
    _truncated(broken)
    for read in (read_safetensors, read_safetensors_folder):
        with pytest.raises(SafetensorError) as err:
            read(broken if read is read_safetensors else broken.parent)
        assert str(broken) in str(err.value) and "incomplete or corrupt" in str(err.value), err.value
        assert isinstance(err.value.__cause__, SafetensorError)  # safetensors' own, chained
    with pytest.raises(FileNotFoundError, match=r"has no \*\.safetensors weights"):
        read_safetensors_folder(tmp_path / "nothing")


def test_the_hf_engine_names_a_truncated_checkpoint_file(tiny: str, tmp_path: Path) -> None:
    from roll_engines.train.hf import HFTrainEngine

    engine = HFTrainEngine(tiny, lr=1e-2, micro_batch_size=3)
    engine.save(tmp_path / "ckpt", tiny)
    shard = _truncated(tmp_path / "ckpt" / "model" / "model.safetensors")
    with pytest.raises(SafetensorError, match="incomplete or corrupt") as err:
        engine.load(tmp_path / "ckpt")
    assert str(shard) in str(err.value)
