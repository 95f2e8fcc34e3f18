"""Megatron optimizer checkpoints: `save_optimizer` writes, and `read_optimizer` then `write_optimizer` load, a
Megatron distributed checkpoint of the optimizer state in a layout-independent format (a run resumes at any
TP/PP/DP layout, with the same kind of optimizer: `optimizer_kind`; another kind is refused naming both kinds and
both layouts, the saved one recorded as `parallel_layout`; a checkpoint the hf or fsdp2 engine wrote is refused
naming that engine: `hf_family_engine`); on CPU and without Apex/TE: quiet
dist_checkpointing calls and the workarounds that let Megatron-Core 0.16's distributed optimizer resume correctly
(`prime_optimizer_state`, `torch_adam_steps_restored`), and the size of an optimizer's state
(`optimizer_state_bytes`). A save starts no process that outlives it (`in_process_write_results`), and returns once
this rank's files are flushed to disk (roll_engines.train._hf_checkpoint.fsync_written: Megatron's forked writers
fsync their shards, but not the folder entries, nor rank 0 its metadata files). A read writes none of the state
a step made (`_staged`): a folder that fails to read leaves the optimizer as it was. As hf's load
(roll_engines.train._optim.load_optimizer), a fresh optimizer (a resume's) is read in place, into the zeros primed
for the read and dropped again on failure, and only a stepped one's moments are read into copies: a copy of every
moment would raise a resume's peak memory by the optimizer's state (8 B a parameter, Adam in fp32). So when writing
a load fails after the read (`written_or_reset`), a fresh optimizer is put back to fresh, and a stepped one, whose
own state no copy was kept of, raises an error that says it must be loaded again. Callers run these under the
engine's CPU shims."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def parts(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside `optimizer` (a ChainedOptimizer's parts, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in the torch optimizers' states (Adam's moments and steps) inside `optimizer`."""
    return sum(
        t.numel() * t.element_size()
        for opt in parts(optimizer)
        for state in opt.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def prime_optimizer_state(optimizer: Any) -> list[tuple[Any, Any]]:
    """Give a fresh optimizer zero moments and step 0, as a first step would: the distributed optimizer builds
    its loading template from its own state, and without Apex/TE it requires every parameter's `step`. Returns the
    (inner optimizer, parameter) pairs it primed."""
    primed = []
    for opt in parts(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(
                        exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), step=torch.tensor(0.0)
                    )
                    primed.append((inner, p))
    return primed


@contextlib.contextmanager
def primed_while_saving(optimizer: Any) -> Iterator[None]:
    """A never-stepped optimizer (a save before the first update, or after steps that trained nothing) saved as
    step 0 with zero moments, what a fresh one starts from: the distributed optimizer's state dict asserted one
    common `step` over a state that has none, so the save failed and the run ended. The primed entries are
    dropped again after the save: the live optimizer stays fresh, and its first update is a fresh one's."""
    fresh = prime_optimizer_state(optimizer)
    try:
        yield
    finally:
        for inner, p in fresh:
            inner.state.pop(p, None)


def zero_steps_restored(state: Any) -> None:
    """Give the torch optimizer states inside a plain (not distributed) Megatron optimizer's loaded `state` back the
    Adam step 0 of a save before the first update (`primed_while_saving`): Megatron writes the common step only
    when it is truthy, so such a checkpoint's moments came back without any `step` and torch's Adam refused them
    (KeyError: 'step'). A state that has its step, or moments saved with it, is left as it is."""
    if isinstance(state, dict):
        inner = state.get("state")
        if isinstance(inner, dict) and "param_groups" in state and "common_step" not in inner:
            per_param = [v for v in inner.values() if isinstance(v, dict)]
            if per_param and not any("step" in v for v in per_param):
                inner["common_step"] = torch.tensor(0.0)
            return
        children: Any = state.values()
    elif isinstance(state, (list, tuple)):
        children = state
    else:
        return
    for child in children:
        zero_steps_restored(child)


@contextlib.contextmanager
def quiet_dist_checkpointing() -> Iterator[None]:
    """Megatron's dist_checkpointing calls torch APIs that torch deprecates (ShardedTensor, DCP's load_state_dict):
    their FutureWarnings are about Megatron's code, not the user's."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


_write_results_lock = threading.Lock()


@contextlib.contextmanager
def in_process_write_results() -> Iterator[None]:
    """Megatron's torch_dist save (FileSystemWriterAsync) hands its write results to the finalize step through a
    module-global queue that its first save in a process creates as `mp.get_context("spawn").Manager().Queue()`:
    a spawned Manager server (a fresh interpreter that re-imports the script: ~270 MB, ~1.2 s of the first save,
    and an EOFError from a script without a `__main__` guard) kept for the process's life and never stopped, so a
    trainer killed by SIGKILL or os._exit (fault-tolerance restarts) left it orphaned, one per rank per restart.
    A synchronous save (`dist_checkpointing.save` without `async_sharded_save`, what roll calls) needs no
    cross-process queue: the writer processes are forked by `write_preloaded_data_multiproc`, which runs in THIS
    process, collects their results through its own fork-context queue and puts the merged dict on the global
    queue; the finalize step reads it back here with `get_nowait`. So inside this block that global is a plain
    `queue.Queue` (a multiprocessing.Queue would not do: its feeder thread can lose the race to `get_nowait`),
    fresh per save (no stale result of a failed save can be read by the next), and the previous value (None, or
    a queue some async Megatron save in this process made) is restored after. Not for `async_sharded_save`,
    whose write runs in another process. A Megatron without the global (another version) saves as it does."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    # The swap is of a module global: roll's saves in one process take turns.
    with _write_results_lock:
        previous = filesystem_async._results_queue
        filesystem_async._results_queue = queue.Queue()
        try:
            yield
        finally:
            filesystem_async._results_queue = previous


@contextlib.contextmanager
def torch_adam_steps_restored(optimizer: Any) -> Iterator[None]:
    """Two bugs of Megatron-Core 0.16's distributed optimizer without Apex/TE, which keeps torch Adam's
    per-parameter `step` in its state: on load it restores `step` from the param groups as ONE tensor shared by
    every parameter (torch Adam then increments it once per parameter per step: wrong bias corrections, measured
    0.34 x lr off on the next step), and it copies every state key from the resharded checkpoint, which has no
    `step` (KeyError). Here a parameter's missing `step` is its restored one, and each gets its own copy."""
    patched = []
    for opt in parts(optimizer):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def set_states(model_param: Any, tensors: dict[str, Any], opt: Any = opt, original: Any = original) -> None:
            if "step" not in tensors:
                group, order = opt.model_param_group_index_map[model_param]
                state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
                if "step" in state:
                    tensors = {**tensors, "step": state["step"]}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # the class's method again
    for opt in parts(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def stepped(optimizer: Any) -> bool:
    """Whether any torch optimizer inside `optimizer` has state (Adam's moments): a fresh one (a resume's) has none."""
    return any(state for opt in parts(optimizer) for state in opt.optimizer.state.values())


@contextlib.contextmanager
def written_or_reset(model: Any, optimizer: Any, fresh: bool) -> Iterator[None]:
    """Around writing a load (`write_optimizer`, then the weights): if it fails, a `fresh` optimizer (no state
    before its `read_optimizer`, which read into its own primed zeros) is put back to fresh, as a failed read
    leaves it: no state, this run's hyperparameters, its masters the model's weights again (the fp32 copies a load
    writes: a bf16 model's are copied from its weights; the distributed optimizer's of an fp32 model are views of
    the weights themselves, so a load wrote the weights: those shards, 4 B a parameter / DP, are kept to put back).
    A stepped optimizer's state was overwritten with no copy kept (one would raise a load's peak memory by the
    optimizer's state): the error (a RuntimeError from the cause) says that it is no longer the engine's and must be
    loaded again, lest training go on from a mix of the checkpoint's optimizer (and masters) and the engine's own."""
    from megatron.core.optimizer import DistributedOptimizer

    from roll_engines.train._settings import reapply, snapshot

    configured = snapshot(optimizer)  # (a load_state_dict failing half-way may leave the checkpoint's)
    kept = []
    if fresh:
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept = [
            (m, m.detach().clone())
            for opt in parts(optimizer)
            if isinstance(opt, DistributedOptimizer)
            for group in opt.optimizer.param_groups
            for m in group["params"]
            if m.untyped_storage().data_ptr() in weights
        ]
    try:
        yield
    except BaseException as e:
        if fresh:
            with torch.no_grad():
                for master, copy in kept:
                    master.copy_(copy)
            for opt in parts(optimizer):
                opt.optimizer.state.clear()
            optimizer.reload_model_params()  # the other masters from the model's weights
            reapply(optimizer, configured)
            raise
        if not isinstance(e, Exception):  # (an interrupt stays one)
            raise
        raise RuntimeError(
            f"writing the checkpoint's optimizer state and weights failed ({type(e).__name__}: {e}): the engine's "
            "optimizer state (and the fp32 masters it holds) is now inconsistent, partly or wholly the checkpoint's "
            "beside the engine's own weights and step; load a checkpoint again before training on"
        ) from e


def optimizer_kind(optimizer: Any) -> str:
    """What the optimizer state's structure depends on: the distributed optimizer or not, and (MoE) whether the
    experts have an optimizer of their own, as Megatron builds it for expert parallelism > 1."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import DistributedOptimizer

    kind = "distributed" if any(isinstance(o, DistributedOptimizer) for o in parts(optimizer)) else "plain"
    return kind + (" (experts apart)" if ps.get_expert_model_parallel_world_size() > 1 else "")


def parallel_layout() -> str:
    """This process's parallel layout in the config's words (TP, PP, CP, EP and the data-parallel size), which a
    checkpoint records (`optimizer_state`) so that a refusal to resume it names the layout that saved it."""
    from megatron.core import parallel_state as ps

    return (
        f"tensor_parallel_size={ps.get_tensor_model_parallel_world_size()}, "
        f"pipeline_parallel_size={ps.get_pipeline_model_parallel_world_size()}, "
        f"context_parallel_size={ps.get_context_parallel_world_size()}, "
        f"expert_model_parallel_size={ps.get_expert_model_parallel_world_size()}, "
        f"data-parallel size {ps.get_data_parallel_world_size()}"
    )


def optimizer_state(model: Any, optimizer: Any, step: int, loading: bool, per_step: int = 1) -> dict[str, Any]:
    """The optimizer's sharded state dict in a layout-independent format: the plain optimizer's is (each state
    tensor is a ShardedTensor of its parameter); the distributed optimizer's `fully_reshardable` format gathers its
    flat shards into per-parameter tensors too. With the schedule's `step` and the optimizer steps per training step
    it was counted at (`per_step`: a resume with another number re-bases it, roll_engines.train._settings.rebased),
    the optimizer's kind and the layout that saved it (`parallel_layout`, for `read_optimizer`'s refusal); a load
    reads the step and count from the checkpoint's common state (the template's are not used)."""
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    if loading:
        prime_optimizer_state(optimizer)
    state = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=loading, metadata=metadata)
    return {
        "optimizer": state,
        "step": step,
        "optimizer_steps_per_step": per_step,
        "kind": optimizer_kind(optimizer),
        "layout": parallel_layout(),
    }


def save_optimizer(folder: Path, model: Any, optimizer: Any, step: int, per_step: int = 1) -> None:
    """Write the optimizer state, the schedule's `step` and the optimizer steps per training step it was counted at
    (`per_step`) to `folder` (collective: every rank writes its part) and flush what this rank wrote (its shards;
    global rank 0 also the metadata) before returning."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from roll_engines.train._hf_checkpoint import fsync_written

    folder.mkdir(parents=True, exist_ok=True)
    with quiet_dist_checkpointing(), in_process_write_results(), primed_while_saving(optimizer):
        dist_checkpointing.save(optimizer_state(model, optimizer, step, False, per_step), str(folder))
    # Megatron names a rank's shards after its global rank, and its coordinator (global rank 0) writes the rest.
    rank = dist.get_rank()
    fsync_written(folder, rank=rank, coordinator=rank == 0)


def read_optimizer(folder: Path, model: Any, optimizer: Any) -> dict[str, Any]:
    """Read what `save_optimizer` wrote, for `write_optimizer` (collective), without writing any of the live state:
    a read that fails (a missing or truncated shard) raises and leaves the optimizer as it was. A checkpoint of
    another optimizer kind, or a folder without one, is refused with what to do."""
    from megatron.core import dist_checkpointing

    if not (folder / "metadata.json").exists():
        written_by = hf_family_engine(folder.parent)
        if written_by is not None:
            raise ValueError(
                f"{folder.parent} is a checkpoint of train_engine={written_by}, not of train_engine=megatron: its "
                "optimizer/ is a torch.distributed.checkpoint keyed by HF parameter names beside an engine.pt, which "
                "Megatron cannot load. Resume it with the engine that wrote it (train_engine=hf and fsdp2 load each "
                "other's checkpoints, at any world size), or start a new Megatron run from its weights "
                f"(model.path={folder.parent / 'model'}; Adam's moments and the LR schedule start afresh)"
            )
        raise FileNotFoundError(
            f"{folder} holds no Megatron distributed checkpoint (metadata.json): it is a weights-only "
            "folder, or one saved by an older roll whose per-rank optimizer files resume only at their layout"
        )
    common = dist_checkpointing.load_common_state_dict(str(folder))
    saved = common.get("kind")
    if saved != optimizer_kind(optimizer):
        # Both layouts named: a checkpoint written before roll recorded its layout says so.
        where = common.get("layout", "a layout this checkpoint does not record")
        raise ValueError(
            f"{folder} holds a {saved} optimizer's state; this run uses a {optimizer_kind(optimizer)} "
            f"one (saved at {where}; this run at {parallel_layout()}; train_engine.use_distributed_optimizer; an "
            "expert optimizer exists at expert_model_parallel_size > 1): resume with the settings that saved it "
            "(any TP/PP/DP layout)"
        )
    primed = prime_optimizer_state(optimizer)  # a fresh optimizer's template (zeros), dropped again on failure
    try:
        with quiet_dist_checkpointing():
            template = optimizer_state(model, optimizer, 0, loading=True)
            return dist_checkpointing.load(_staged(template, model, optimizer, primed), str(folder))
    except BaseException:  # (DCP's CheckpointException is no Exception)
        for inner, p in primed:
            inner.state.pop(p, None)
        raise


def hf_family_engine(folder: Path) -> str | None:
    """Which engine of the hf family wrote checkpoint `folder` (`model/`, `optimizer/` and an `engine.pt`:
    roll_engines.train._hf_checkpoint): "hf" or "fsdp2" as the config.yaml in `folder` or its parent records it (a
    run's `actor/` folder lies in the step folder whose config.yaml roll_core.checkpoint writes), "hf or fsdp2" where
    none says; None for a folder without an `engine.pt` (Megatron writes none)."""
    import yaml

    if not (folder / "engine.pt").is_file():
        return None
    for config in (folder / "config.yaml", folder.parent / "config.yaml"):
        try:
            name = (yaml.safe_load(config.read_text()) or {}).get("train_engine", {}).get("name")
        except (OSError, yaml.YAMLError, AttributeError):  # absent, unreadable or not a run's config
            continue
        if name in ("hf", "fsdp2"):
            return name
    return "hf or fsdp2"


def _staged(state: dict[str, Any], model: Any, optimizer: Any, primed: list[tuple[Any, Any]]) -> dict[str, Any]:
    """`state` (a sharded state dict to load) with every tensor that is live state (the plain optimizer's template
    holds Adam's own moments; dist_checkpointing reads into the template's tensors in place: a read failing half-way
    left some of them loaded) replaced by an uninitialised copy to read into. Not copied: the state `primed` for this
    read (`prime_optimizer_state`'s pairs: a fresh optimizer's zeros, which `read_optimizer` drops again when the
    read fails, leaving it fresh), and tensors the template made for the load (the distributed optimizer's gathered
    ones): no second copy of either."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    live = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for opt in parts(optimizer):
        live.update(p.untyped_storage().data_ptr() for g in opt.optimizer.param_groups for p in g["params"])
        for st in opt.optimizer.state.values():
            live.update(t.untyped_storage().data_ptr() for t in st.values() if torch.is_tensor(t))
    # (each primed tensor has storage of its own, made by zeros_like: no parameter or stepped moment shares it)
    live -= {
        t.untyped_storage().data_ptr() for inner, p in primed for t in inner.state[p].values() if torch.is_tensor(t)
    }
    for value in nested_values(state):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and torch.is_tensor(value.data):
            if value.data.untyped_storage().data_ptr() in live:
                value.data = torch.empty_like(value.data)
    return state


def write_optimizer(optimizer: Any, loaded: dict[str, Any]) -> int:
    """Load `read_optimizer`'s state into `optimizer` and return the saved step (as counted: the engine re-bases
    it). The optimizer's configured hyperparameters stay this run's (roll_engines.train._settings)."""
    from roll_engines.train._settings import reapply, snapshot

    configured = snapshot(optimizer)  # this run's weight decay and betas: the checkpoint's would win
    with quiet_dist_checkpointing():
        if optimizer_kind(optimizer).startswith("plain"):
            zero_steps_restored(loaded["optimizer"])
        with torch_adam_steps_restored(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
    # The LR is set from this run's base_lr and schedule before every step, at the engine's (re-based) position.
    reapply(optimizer, configured)
    return int(loaded["step"])
