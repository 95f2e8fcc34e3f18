"""Rank-0 loading for the fsdp2 engine (roll_engines.train.fsdp2): only rank 0 reads a checkpoint.

Contract (every function here is collective over the default process group unless it says otherwise):
- `instantiate`: rank 0 loads the model with `from_pretrained` (host memory, as the single-process engine does:
  same weights, same seeded initialisation of anything the checkpoint lacks, e.g. a critic's value head); every
  other rank builds the same architecture on the meta device from the config alone (no weights, no memory). A rank
  whose meta build fails or differs from rank 0's model (names, shapes, dtypes, tied parameters, buffers) falls
  back to `from_pretrained` itself and logs why; a rank-0 failure raises on every rank.
- `check_same_structure`: after the engine's own changes (LoRA adapters, ...), every rank's model must still
  match rank 0's, else RuntimeError on every rank.
- `materialize`: after `fully_shard`, allocate the meta ranks' shards (`to_empty`), then broadcast rank 0's full
  tensors one at a time; each rank keeps its shard (torch's `set_model_state_dict(..., broadcast_from_rank0=True)`).
  Buffers outside the state dict (rotary `inv_freq`, ...) are broadcast from rank 0's model; nothing is left on meta.
- `load_from_rank0`: rank 0's full state dict (other ranks pass anything: it is not read) sharded over the ranks;
  missing, unexpected or misshapen tensors raise on every rank before anything is written (a tied LM head,
  carried once under the embedding's name, is not missing).
- `read_config`: the model's config on every rank. With `trust_remote_code`, rank 0 reads it and imports the
  model's code first and the other ranks only after it: transformers copies a checkpoint's code into its module
  cache (HF_MODULES_CACHE) on every load, and processes copying at once can import a half-written file
  (huggingface/transformers#27421); that covers a cache the ranks share (a shared home directory): with one cache
  per node, the ranks of another node still copy at once. Remote-code models take the meta build like any other.
- `tensors_from_rank0`: a small set of tensors (a LoRA adapter) read on rank 0 alone and broadcast whole to every
  rank; a failure to read raises on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from roll_engines.train._hf_checkpoint import mismatch

log = logging.getLogger(__name__)

#: (kind, name, shape or the first name of a shared parameter, dtype) of every parameter and buffer of a model.
Structure = list[tuple[str, str, Any, str]]


def meta_refusal(config: Any) -> str | None:
    """Why a model of `config` cannot be built on the meta device and filled from rank 0 (None if it can): a
    quantized checkpoint's modules are replaced by `from_pretrained`'s quantizer, which `from_config` would not run.
    Local (no collective)."""
    if getattr(config, "quantization_config", None) is not None:
        return "a quantized checkpoint (from_pretrained replaces its layers)"
    return None


def read_config(path: str, model_class: Any, kwargs: Mapping[str, Any], device: torch.device) -> Any:
    """The config of `path` with the `from_pretrained` arguments `kwargs` (trust_remote_code, num_labels), read by
    every rank (see the module's contract; collective with trust_remote_code only).

    Every rank reads config.json itself rather than receiving rank 0's config object: it is a few kB, and a
    remote-code config arrives as an instance of the checkpoint's own class, which a rank can unpickle only after
    importing that code from the checkpoint folder, i.e. reading it anyway."""
    from transformers import AutoConfig

    trust = bool(kwargs.get("trust_remote_code", False))
    config_kwargs = {"num_labels": kwargs["num_labels"]} if "num_labels" in kwargs else {}

    def read() -> Any:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust, **config_kwargs)
        ref = (getattr(config, "auto_map", None) or {}).get(model_class.__name__) if trust else None
        if ref is not None:  # import the model's code now: transformers caches it (copies it) at its first import
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            get_class_from_dynamic_module(ref, path)
        return config

    if not trust:
        return read()
    rank0 = dist.get_rank() == 0
    config, failure = None, None
    if rank0:
        try:
            config = read()
        except Exception as e:  # must reach the other ranks, which wait for rank 0 here
            failure = e
    problem = _broadcast_object(f"{type(failure).__name__}: {failure}" if failure else None, device)
    if failure is not None:
        raise failure
    if problem is not None:
        raise RuntimeError(f"rank 0 could not read the config of {path}: {problem}")
    return config if rank0 else read()


def build_on_meta(model_class: Any, config: Any, kwargs: Mapping[str, Any]) -> torch.nn.Module:
    """`model_class` of `config` (`read_config`'s) with every parameter and buffer on the meta device, built with
    the `from_pretrained` arguments `kwargs` (dtype, attn_implementation, trust_remote_code; num_labels is the
    config's). Local."""
    kwargs = {k: v for k, v in kwargs.items() if k != "num_labels"}
    with torch.device("meta"):
        model = model_class.from_config(config, **kwargs)
    # A tensor kept as a plain attribute (not a parameter or buffer) would stay on meta: neither `to_empty` nor
    # the broadcast reaches it.
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, Tensor) and value.is_meta:
                raise TypeError(f"{name or 'the model'}.{attr} is a tensor outside its parameters and buffers")
    return model


def structure(model: torch.nn.Module) -> Structure:
    """Every parameter's and buffer's name, shape and dtype, and which parameters share one tensor. Local."""
    out: Structure = []
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied = first.setdefault(id(p), name)
        out.append(("param", name, tuple(p.shape) if tied == name else f"tied to {tied}", str(p.dtype)))
    out += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    return out


def _difference(mine: Structure, rank0: Structure) -> str | None:
    if mine == rank0:
        return None
    a, b = set(mine), set(rank0)
    return f"only here: {sorted(a - b)[:3]}, only on rank 0: {sorted(b - a)[:3]}"


def _broadcast_object(obj: Any, device: torch.device) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=device)  # device: nccl sends objects from this rank's GPU
    return box[0]


def instantiate(
    load: Callable[[], torch.nn.Module], build: Callable[[], torch.nn.Module], device: torch.device, what: str
) -> tuple[torch.nn.Module, bool]:
    """(model, whether it is on the meta device): `load()` on rank 0, `build()` elsewhere (see the module's
    contract); `what` names the checkpoint in errors and log lines."""
    rank = dist.get_rank()
    model, failure = None, None
    try:
        model = load() if rank == 0 else build()
    except Exception as e:  # rank 0's must reach the other ranks (they would wait for it forever); see below
        failure = e
    rank0 = _broadcast_object(
        (None if failure is None else f"{type(failure).__name__}: {failure}", structure(model) if model else None)
        if rank == 0
        else None,
        device,
    )
    if rank0[0] is not None:
        if rank == 0:
            raise failure
        raise RuntimeError(f"rank 0 could not load {what}: {rank0[0]}")
    if rank == 0:
        return model, False
    why = f"{type(failure).__name__}: {failure}" if failure is not None else _difference(structure(model), rank0[1])
    if why is None:
        return model, True
    log.warning("fsdp2 rank %d reads %s itself: the model cannot be built on the meta device (%s)", rank, what, why)
    return load(), False


def check_same_structure(model: torch.nn.Module, device: torch.device) -> None:
    """RuntimeError on every rank if some rank's model differs from rank 0's (see `structure`)."""
    mine = structure(model)
    why = _difference(mine, _broadcast_object(mine if dist.get_rank() == 0 else None, device))
    flag = torch.tensor([0 if why is None else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if why is not None:
        raise RuntimeError(f"fsdp2: this rank's model differs from rank 0's: {why}")
    if flag.item():
        raise RuntimeError("fsdp2: another rank's model differs from rank 0's (see that rank's error)")


def full_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """Rank 0's unsharded state dict (the live tensors, no copies) with each shared (tied) parameter once: the
    other names of a shared parameter load through it. Local; call before `fully_shard`."""
    state = model.state_dict()
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def materialize(model: torch.nn.Module, source: dict[str, Tensor] | None, on_meta: bool, device: torch.device) -> None:
    """Allocate this rank's shards if `on_meta`, then fill every parameter and buffer from rank 0 (`source`:
    rank 0's `full_state`, None elsewhere). Call after `fully_shard`."""
    if on_meta:
        model.to_empty(device=device)
    load_from_rank0(model, source or {}, device, check=False)
    persistent = set(model.state_dict().keys())
    for name, b in model.named_buffers():
        if name not in persistent:  # rank 0's was computed by the model's constructor (rotary inv_freq, ...)
            dist.broadcast(b, src=0)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"fsdp2: {left[:5]} left on the meta device after loading")


def check_from_rank0(model: torch.nn.Module, weights: Mapping[str, Tensor], device: torch.device) -> None:
    """RuntimeError on every rank unless rank 0's `weights` fill `model` exactly (_hf_checkpoint.mismatch)."""
    problem = _broadcast_object(mismatch(model, weights) if dist.get_rank() == 0 else None, device)
    if problem is not None:
        raise RuntimeError(problem)


def load_from_rank0(
    model: torch.nn.Module, weights: Mapping[str, Tensor], device: torch.device, check: bool = True
) -> None:
    """Shard rank 0's full `weights` over the ranks (`check`: first refuse, on every rank, weights that do not
    fill the model exactly)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = dist.get_rank() == 0
    if check:
        check_from_rank0(model, weights, device)
    # strict=False: a shared parameter's other names (and, unchecked, nothing else) are absent from `weights`;
    # torch fills the absent keys with the model's own tensors, so they load as themselves.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, dict(weights) if rank0 else {}, options=options)


def tensors_from_rank0(read: Callable[[], Mapping[str, Tensor]], device: torch.device, what: str) -> dict[str, Tensor]:
    """`read()`'s tensors, called on rank 0 only, on every rank (CPU copies, broadcast one at a time); a failure of
    rank 0's `read` raises there and a RuntimeError naming `what` on the other ranks."""
    rank0 = dist.get_rank() == 0
    tensors: dict[str, Tensor] = {}
    failure = None
    if rank0:
        try:
            tensors = dict(read())
        except Exception as e:  # must reach the other ranks, which wait for rank 0's broadcast
            failure = e
    why = f"{type(failure).__name__}: {failure}" if failure else None
    layout = _broadcast_object((why, [(k, t.shape, t.dtype) for k, t in tensors.items()]) if rank0 else None, device)
    if failure is not None:
        raise failure
    if layout[0] is not None:
        raise RuntimeError(f"rank 0 could not read {what}: {layout[0]}")
    out = {}
    for name, shape, dtype in layout[1]:
        t = tensors[name].to(device) if rank0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)  # on the device: nccl/hccl broadcast device tensors only
        out[name] = t.cpu()
    return out
