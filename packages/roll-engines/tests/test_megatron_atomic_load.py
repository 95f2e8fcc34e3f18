"""A `megatron` engine's checkpoint `load` is all or nothing (roll_engines.train.megatron._weights): a folder that
fails to load raises and leaves the model's weights, the optimizer's state (Adam's moments and step, the distributed
optimizer's fp32 masters) and the schedule's step as they were. On the old code the weights were written first, so
a folder without `optimizer/` or with a truncated optimizer shard raised with the new weights loaded, and a
misshapen tensor was refused only once the tensors before it had been copied. As test_atomic_load.py for the
hf/fsdp2 engines; TP=PP=1 in this process over gloo, the plain and the distributed optimizer, full and LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")

from safetensors import SafetensorError  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from roll_core.testing.broken_checkpoints import broken_checkpoint  # noqa: E402

#: What a failed load raises: a clear error, or the reader's own for an unreadable shard (DCP's: a BaseException).
LOAD_ERRORS = (FileNotFoundError, RuntimeError, ValueError, SafetensorError, CheckpointException)


def _engine(tiny: str, distributed: bool, **kw: Any) -> Any:
    from roll_engines.train.megatron import MegatronTrainEngine

    settings = {"dist_backend": "gloo", "micro_batch_size": 3, "lr": 1e-2, "use_distributed_optimizer": distributed}
    return MegatronTrainEngine(tiny, **settings, **kw)


def _state(engine: Any) -> dict[str, Any]:
    """Everything a load may change: the weights, the torch optimizers' parameters (the masters) and state, the step."""
    from roll_engines.train.megatron._checkpoint import parts

    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    inner = [o.optimizer for o in parts(engine.optimizer)]
    masters = [p.detach().clone() for o in inner for g in o.param_groups for p in g["params"]]
    adam = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in o.state[p].items()}
        for o in inner
        for g in o.param_groups
        for p in g["params"]
    ]
    return {"params": params, "masters": masters, "adam": adam, "step": engine._step}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["step"] == want["step"]
    assert got["params"].keys() == want["params"].keys()
    for name, w in want["params"].items():
        assert torch.equal(got["params"][name], w), name
    assert len(got["masters"]) == len(want["masters"]) and len(got["adam"]) == len(want["adam"])
    for i, (g, w) in enumerate(zip(got["masters"], want["masters"])):
        assert torch.equal(g, w), f"master {i}"
    for i, (g, w) in enumerate(zip(got["adam"], want["adam"])):
        assert g.keys() == w.keys(), i
        for k in w:
            assert torch.equal(torch.as_tensor(g[k]), torch.as_tensor(w[k])), (i, k)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "distributed"])
def trained(request: pytest.FixtureRequest, tiny: str, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(engine, its checkpoint, a function that steps it): a test steps it before its load, so that its state
    differs from the checkpoint's in every part a load writes (whatever an earlier test's load left)."""
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch

    engine = _engine(tiny, request.param)
    batch, objective = toy_batch(tiny), PolicyObjective()
    engine.train_step(batch, objective)
    saved = tmp_path_factory.mktemp("megatron-ckpt") / "saved"
    engine.save(saved, tiny)
    return engine, saved, lambda: engine.train_step(batch, objective)


FULL = ["no-optimizer", "truncated-optimizer-shard", "missing-model-shard", "misshapen-tensor"]
FULL += ["truncated-model-shard"]


@pytest.mark.parametrize("how", FULL)
def test_a_failed_load_leaves_the_engine_as_it_was(trained: tuple, tmp_path: Path, how: str) -> None:
    engine, saved, step = trained
    step()
    before = _state(engine)
    with pytest.raises(LOAD_ERRORS) as got:
        engine.load(broken_checkpoint(saved, tmp_path, how))
    _assert_same(_state(engine), before)
    if how in ("missing-model-shard", "misshapen-tensor", "truncated-model-shard"):  # the error names the folder
        assert str(tmp_path / how / "model") in str(got.value), got.value
    if how == "truncated-model-shard":  # safetensors' own type, with a message that says what is wrong
        assert isinstance(got.value, SafetensorError) and "incomplete or corrupt" in str(got.value), got.value


def test_a_whole_folder_still_loads(trained: tuple) -> None:
    engine, saved, step = trained
    step()
    engine.load(saved)
    assert engine._step == 1


def test_a_fresh_engine_stays_fresh_after_a_failed_load(tiny: str, trained: tuple, tmp_path: Path) -> None:
    """A resume's engine has no optimizer state yet; the load primes it (zeros) to read into, and drops it again
    when the read fails: the engine's first step is a fresh Adam's."""
    from roll_engines.train.megatron._checkpoint import parts

    engine, saved, _ = trained
    fresh = _engine(tiny, any(type(o).__name__ == "DistributedOptimizer" for o in parts(engine.optimizer)))
    before = _state(fresh)
    with pytest.raises(LOAD_ERRORS):
        fresh.load(broken_checkpoint(saved, tmp_path, "truncated-optimizer-shard"))
    assert not any(o.optimizer.state for o in parts(fresh.optimizer))
    _assert_same(_state(fresh), before)


def test_a_failed_lora_load_leaves_the_adapter_as_it_was(tiny: str, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch

    engine = _engine(tiny, False, lora_rank=4, lora_alpha=8.0)
    batch, objective = toy_batch(tiny), PolicyObjective()
    engine.train_step(batch, objective)
    engine.save(tmp_path / "saved", tiny)
    engine.train_step(batch, objective)
    before = _state(engine)
    for how in ("no-optimizer", "truncated-optimizer-shard", "no-adapter"):
        with pytest.raises(LOAD_ERRORS):
            engine.load(broken_checkpoint(tmp_path / "saved", tmp_path, how))
        _assert_same(_state(engine), before)
    engine.load(tmp_path / "saved")
    assert engine._step == 1


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in a nested state dict, in its order."""
    if torch.is_tensor(tree):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return [t for x in items for t in _tensors(x)]


def _live(engine: Any) -> set[int]:
    """The storages of the engine's torch optimizer states (Adam's moments and steps)."""
    from roll_engines.train.megatron._checkpoint import parts

    states = [st for o in parts(engine.optimizer) for st in o.optimizer.state.values()]
    return {t.untyped_storage().data_ptr() for st in states for t in st.values() if torch.is_tensor(t)}


def test_a_fresh_engine_reads_in_place_and_a_stepped_one_into_copies(
    tiny: str, trained: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume's engine reads the checkpoint into the zeros primed for the read, as hf's does (a failed read drops
    them: test_a_fresh_engine_stays_fresh_after_a_failed_load): a copy of every moment to read into raised a
    resume's peak memory by the optimizer's state, so a resume that fit could run out. A stepped engine's are read
    into copies (its own stay as they were until the load is written). The distributed optimizer reads into tensors
    the template made either way (it gathers its shards)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from roll_engines.train.megatron._checkpoint import parts, read_optimizer

    engine, saved, step = trained
    distributed = any(type(o).__name__ == "DistributedOptimizer" for o in parts(engine.optimizer))
    read_into: list[list[torch.Tensor]] = []  # the tensors each read's sharded state dict reads into
    load = dist_checkpointing.load

    def spy(state: Any, folder: str) -> Any:
        sharded = (ShardedTensor, ShardedTensorFactory)
        read_into.append([v.data for v in nested_values(state) if isinstance(v, sharded) and torch.is_tensor(v.data)])
        return load(state, folder)

    monkeypatch.setattr(dist_checkpointing, "load", spy)
    fresh = _engine(tiny, distributed)
    with fresh._shims():
        in_place = _tensors(read_optimizer(saved / "optimizer", fresh.model, fresh.optimizer)["optimizer"])
    targets = read_into.pop()
    assert targets
    read_live = sum(t.untyped_storage().data_ptr() in _live(fresh) for t in targets)
    assert read_live == (0 if distributed else len(targets))  # plain: every moment read into the live zeros
    step()
    with engine._shims():
        copies = _tensors(read_optimizer(saved / "optimizer", engine.model, engine.optimizer)["optimizer"])
    assert not any(t.untyped_storage().data_ptr() in _live(engine) for t in read_into.pop())
    assert len(copies) == len(in_place)  # the same checkpoint, read both ways
    for i, (a, b) in enumerate(zip(in_place, copies)):
        assert torch.equal(a, b), i
    fresh.load(saved)  # and it loads as a whole
    assert fresh._step == 1


@pytest.mark.parametrize("where", ["weights", "optimizer"])
def test_a_fresh_engine_stays_fresh_when_writing_the_load_fails(
    tiny: str, trained: tuple, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A resume's engine reads the optimizer's state in place (into the zeros primed for the read): when writing
    the load fails after the read (the weights, written last; or the optimizer's load_state_dict once it has
    loaded), the optimizer is put back to fresh (no state, this run's hyperparameters, its masters the model's
    weights), as a failed read leaves it. On the old code it kept the checkpoint's moments (and the distributed
    optimizer of an fp32 model the checkpoint's weights, its masters being views of them) with the step still 0."""
    from roll_engines.train._settings import snapshot
    from roll_engines.train.megatron import _convert
    from roll_engines.train.megatron._checkpoint import parts

    engine, saved, _ = trained
    fresh = _engine(tiny, any(type(o).__name__ == "DistributedOptimizer" for o in parts(engine.optimizer)))
    before, configured = _state(fresh), snapshot(fresh.optimizer)

    def write_mapped(*args: Any, **kw: Any) -> None:
        raise OSError("no space left on device")

    def load_state_dict(state: Any, load: Any = fresh.optimizer.load_state_dict) -> None:
        load(state)
        raise OSError("no space left on device")

    if where == "weights":
        monkeypatch.setattr(_convert, "write_mapped", write_mapped)
    else:
        monkeypatch.setattr(fresh.optimizer, "load_state_dict", load_state_dict)
    with pytest.raises(OSError, match="no space"):
        fresh.load(saved)
    assert not any(st for o in parts(fresh.optimizer) for st in o.optimizer.state.values())
    _assert_same(_state(fresh), before)
    assert snapshot(fresh.optimizer) == configured
    monkeypatch.undo()
    fresh.load(saved)  # and the whole folder still loads
    assert fresh._step == 1


def test_a_stepped_engine_says_its_optimizer_must_be_reloaded_when_writing_fails(
    trained: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stepped engine's optimizer is written from copies and not kept (a copy of its state would raise a load's
    peak memory by it): when writing the load fails after the optimizer's state was written, the error says that
    the optimizer's state is the checkpoint's, not the engine's, and that it must be loaded again."""
    from roll_engines.train.megatron import _convert

    engine, saved, step = trained
    step()
    position = engine._step

    def write_mapped(*args: Any, **kw: Any) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(_convert, "write_mapped", write_mapped)
    with pytest.raises(RuntimeError, match=r"inconsistent.*load a checkpoint again") as got:
        engine.load(saved)
    assert isinstance(got.value.__cause__, OSError)
    assert engine._step == position
    monkeypatch.undo()
    engine.load(saved)  # a load that succeeds makes it whole again
    assert engine._step == 1
