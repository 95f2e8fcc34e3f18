"""A checkpoint `load` is all or nothing (roll_engines.train._hf_checkpoint.HFWeightsAndCheckpoints.load): a folder
that fails to load raises and leaves the engine's weights, Adam's moments and LR schedule as they were. The driver
never hands an engine an incomplete folder, but a direct caller could; on the old code the weights were written
first, so a folder without `optimizer/` or with a truncated optimizer shard raised with the new weights loaded,
and the hf engine's `load_state_dict` copied every tensor it could before refusing a misshapen one. The hf engine
and the fsdp2 engine (a gloo group of one in this process: rank 0 reads, checks and broadcasts), full and LoRA."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch


@pytest.fixture
def make_engine(tiny: str):
    """`make_engine(kind, **kw)`: an hf or fsdp2 engine of the tiny model; fsdp2's group of one ends after the test."""
    made = []

    def make(kind: str, **kw: Any) -> Any:
        from roll_engines.train.fsdp2 import FSDP2TrainEngine
        from roll_engines.train.hf import HFTrainEngine

        settings = {"lr": 1e-2, "micro_batch_size": 3, "weight_decay": 0.1, "total_steps": 10, **kw}
        engine = (
            FSDP2TrainEngine(tiny, dist_backend="gloo", **settings)
            if kind == "fsdp2"
            else HFTrainEngine(tiny, **settings)
        )
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def _plain(t: Any) -> Any:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().cpu().clone() if torch.is_tensor(t) else t


def _state(engine: Any) -> dict[str, Any]:
    """Everything a load may change: weights (LoRA: the adapters too), Adam's state, the schedule's position."""
    params = {n: _plain(p) for n, p in engine.model.named_parameters()}
    adam = {i: {k: _plain(v) for k, v in st.items()} for i, st in enumerate(engine.optimizer.state.values())}
    return {"params": params, "adam": adam, "schedule": engine.scheduler.last_epoch}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["schedule"] == want["schedule"]
    assert set(got["params"]) == set(want["params"]) and got["adam"].keys() == want["adam"].keys()
    for name, w in want["params"].items():
        assert torch.equal(got["params"][name], w), name
    for i, st in want["adam"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got["adam"][i][k]), torch.as_tensor(v)), (i, k)


def _broken(saved: Path, root: Path, how: str) -> Path:
    """A copy of the checkpoint `saved`, broken `how`."""
    folder = root / how
    shutil.copytree(saved, folder)
    model = folder / "model" / "model.safetensors"
    if how == "no-optimizer":
        shutil.rmtree(folder / "optimizer")
    elif how == "no-engine-state":
        (folder / "engine.pt").unlink()
    elif how == "truncated-optimizer-shard":
        for shard in (folder / "optimizer").glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how in ("missing-model-shard", "misshapen-tensor", "truncated-model-shard"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(model)
        if how == "truncated-model-shard":
            model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
        elif how == "misshapen-tensor":  # the last tensor in name order one row short; the others fine
            last = sorted(tensors)[-1]
            save_file({**tensors, last: tensors[last][:-1].contiguous()}, model)
        else:  # two shards, the second lost
            names = sorted(tensors)
            save_file({k: tensors[k] for k in names[: len(names) // 2]}, model)
    else:
        raise ValueError(how)
    return folder


#: What a failed load raises: a clear error, or the reader's own for an unreadable shard (DCP's: a BaseException).
LOAD_ERRORS = (FileNotFoundError, RuntimeError, ValueError, SafetensorError, CheckpointException)
FULL = ["no-optimizer", "no-engine-state", "truncated-optimizer-shard", "missing-model-shard", "misshapen-tensor"]
FULL += ["truncated-model-shard"]


@pytest.mark.parametrize("how", FULL)
@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_failed_load_leaves_the_engine_as_it_was(make_engine, tmp_path: Path, kind: str, how: str, tiny: str) -> None:
    engine = make_engine(kind)
    batch, objective = toy_batch(tiny), PolicyObjective()
    engine.train_step(batch, objective)
    engine.save(tmp_path / "saved", tiny)
    engine.train_step(batch, objective)  # weights, moments and schedule now differ from the checkpoint's
    before = _state(engine)
    with pytest.raises(LOAD_ERRORS) as got:
        engine.load(_broken(tmp_path / "saved", tmp_path, how))
    if how in ("missing-model-shard", "misshapen-tensor"):
        assert "checkpoint mismatch" in str(got.value), got.value
    _assert_same(_state(engine), before)
    engine.load(tmp_path / "saved")  # a whole folder still loads
    assert engine.scheduler.last_epoch == 1


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_failed_lora_load_leaves_the_adapter_as_it_was(make_engine, tmp_path: Path, kind: str, tiny: str) -> None:
    pytest.importorskip("peft")
    engine = make_engine(kind, lora_rank=4, lora_alpha=8.0)
    batch, objective = toy_batch(tiny), PolicyObjective()
    engine.train_step(batch, objective)
    engine.save(tmp_path / "saved", tiny)
    engine.train_step(batch, objective)
    before = _state(engine)
    for how in ("no-optimizer", "truncated-optimizer-shard"):
        with pytest.raises(LOAD_ERRORS):
            engine.load(_broken(tmp_path / "saved", tmp_path, how))
        _assert_same(_state(engine), before)
    engine.load(tmp_path / "saved")
    assert engine.scheduler.last_epoch == 1


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_fresh_engine_stays_fresh_after_a_failed_load(make_engine, tmp_path: Path, kind: str, tiny: str) -> None:
    """A resume's engine has no optimizer state yet; the load fills it (zeros) to read into, and drops it again when
    the read fails: the engine's first step is a fresh Adam's."""
    saver = make_engine(kind)
    saver.train_step(toy_batch(tiny), PolicyObjective())
    saver.save(tmp_path / "saved", tiny)
    fresh = make_engine(kind)
    before = _state(fresh)
    with pytest.raises(LOAD_ERRORS):
        fresh.load(_broken(tmp_path / "saved", tmp_path, "truncated-optimizer-shard"))
    assert not fresh.optimizer.state
    _assert_same(_state(fresh), before)
