"""A checkpoint `load` is all or nothing (roll_engines.train._hf_checkpoint.HFWeightsAndCheckpoints.load): a folder
that fails to load raises and leaves the engine's weights, Adam's moments and LR schedule as they were. The driver
never hands an engine an incomplete folder, but a direct caller could; on the old code the weights were written
first, so a folder without `optimizer/` or with a truncated optimizer shard raised with the new weights loaded,
and the hf engine's `load_state_dict` copied every tensor it could before refusing a misshapen one. The hf engine
and the fsdp2 engine (a gloo group of one in this process: rank 0 reads, checks and broadcasts), full and LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_core.testing.broken_checkpoints import broken_checkpoint


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
        engine.load(broken_checkpoint(tmp_path / "saved", tmp_path, how))
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
            engine.load(broken_checkpoint(tmp_path / "saved", tmp_path, how))
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
        fresh.load(broken_checkpoint(tmp_path / "saved", tmp_path, "truncated-optimizer-shard"))
    assert not fresh.optimizer.state
    _assert_same(_state(fresh), before)


def _groups(engine: Any) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters, group by group (lr, weight decay, betas, ...)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]


def _fail_writing(monkeypatch: pytest.MonkeyPatch, engine: Any, where: str, error: BaseException) -> None:
    """Make writing `engine`'s next load fail after a good read: the optimizer's write loads the checkpoint's state
    (DCP's set_optimizer_state_dict), then raises; or the weights' write (written last) raises."""
    import torch.distributed.checkpoint.state_dict as dcp_state

    if where == "optimizer":
        write = dcp_state.set_optimizer_state_dict

        def loads_then_raises(*args: Any, **kw: Any) -> None:
            write(*args, **kw)
            raise error

        monkeypatch.setattr(dcp_state, "set_optimizer_state_dict", loads_then_raises)
    else:

        def raises(*args: Any, **kw: Any) -> None:
            raise error

        monkeypatch.setattr(engine, "_load_full_weights", raises)


@pytest.mark.parametrize("where", ["optimizer", "weights"])
@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_fresh_engine_stays_fresh_when_writing_the_load_fails(
    make_engine, tmp_path: Path, kind: str, where: str, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume's engine reads the optimizer's state in place (into the zeros primed for the read): when writing the
    load fails after the read (the optimizer's write once it has loaded, or the weights', written after it), the
    optimizer is put back to fresh (no state, its own hyperparameters), as a failed read leaves it, and the error is
    the write's own. On the old code it kept the checkpoint's moments (fsdp2: DTensor shards) with the step at 0."""
    saver = make_engine(kind)
    saver.train_step(toy_batch(tiny), PolicyObjective())
    saver.save(tmp_path / "saved", tiny)
    fresh = make_engine(kind)
    before, groups = _state(fresh), _groups(fresh)
    _fail_writing(monkeypatch, fresh, where, OSError("no space left on device"))
    with pytest.raises(OSError, match="no space"):
        fresh.load(tmp_path / "saved")
    assert not fresh.optimizer.state
    _assert_same(_state(fresh), before)
    assert _groups(fresh) == groups
    monkeypatch.undo()
    fresh.load(tmp_path / "saved")  # and the whole folder still loads
    _assert_same(_state(fresh), _state(saver))


@pytest.mark.parametrize("where", ["optimizer", "weights"])
@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_stepped_engine_says_its_optimizer_must_be_reloaded_when_writing_fails(
    make_engine, tmp_path: Path, kind: str, where: str, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stepped engine's optimizer is written from copies and not kept (a copy of its state would raise a load's
    peak memory by it): when writing the load fails after the read, the error (a RuntimeError from the write's)
    says that the optimizer's state is inconsistent and that a checkpoint must be loaded again. On the old code the
    write's own error came, with the checkpoint's moments beside the engine's weights and schedule position."""
    engine = make_engine(kind)
    batch, objective = toy_batch(tiny), PolicyObjective()
    engine.train_step(batch, objective)
    engine.save(tmp_path / "saved", tiny)
    saved = _state(engine)
    engine.train_step(batch, objective)
    _fail_writing(monkeypatch, engine, where, OSError("no space left on device"))
    with pytest.raises(RuntimeError, match=r"inconsistent.*load a checkpoint again") as got:
        engine.load(tmp_path / "saved")
    assert isinstance(got.value.__cause__, OSError)
    assert engine.scheduler.last_epoch == 2  # (nothing after the failed write ran)
    monkeypatch.undo()
    engine.load(tmp_path / "saved")  # a load that succeeds makes it whole again
    _assert_same(_state(engine), saved)


def test_an_interrupt_while_writing_a_load_stays_an_interrupt(
    make_engine, tmp_path: Path, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during the write of a stepped engine's load reaches the caller as itself, not as an error."""
    engine = make_engine("hf")
    engine.train_step(toy_batch(tiny), PolicyObjective())
    engine.save(tmp_path / "saved", tiny)
    _fail_writing(monkeypatch, engine, "weights", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.load(tmp_path / "saved")


@pytest.mark.parametrize("stepped", [False, True])
def test_a_lora_engine_whose_optimizer_write_fails(
    make_engine, tmp_path: Path, tiny: str, monkeypatch: pytest.MonkeyPatch, stepped: bool
) -> None:
    """LoRA: the adapter (written before the optimizer) is put back, and the optimizer's failed write leaves a fresh
    engine fresh or tells a stepped one to load a checkpoint again."""
    pytest.importorskip("peft")
    saver = make_engine("hf", lora_rank=4, lora_alpha=8.0)
    saver.train_step(toy_batch(tiny), PolicyObjective())
    saver.save(tmp_path / "saved", tiny)
    engine = saver if stepped else make_engine("hf", lora_rank=4, lora_alpha=8.0)
    if stepped:
        engine.train_step(toy_batch(tiny), PolicyObjective())  # its adapter now differs from the checkpoint's
    before = _state(engine)
    _fail_writing(monkeypatch, engine, "optimizer", OSError("no space left on device"))
    with pytest.raises(RuntimeError if stepped else OSError) as got:
        engine.load(tmp_path / "saved")
    if stepped:
        assert "load a checkpoint again" in str(got.value) and isinstance(got.value.__cause__, OSError)
        for name, p in _state(engine)["params"].items():  # the adapter put back
            assert torch.equal(p, before["params"][name]), name
    else:
        assert not engine.optimizer.state
        _assert_same(_state(engine), before)
