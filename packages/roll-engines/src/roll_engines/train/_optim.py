"""The `hf`/`fsdp2` engines' optimizer pieces: the LR schedule, the param groups (no weight decay on biases and
norms), AdamW's kernel choice and the optimizer-state checkpoint (torch.distributed.checkpoint, keyed by parameter
name, sharded by rank, resharded on load: a run saved on N ranks resumes on M ranks or in one process). Saving an
optimizer that has not stepped yet leaves its next update unchanged (and so does resuming from that checkpoint).
A load is a read (`read_optimizer`: a failure leaves the optimizer as it was) and then a write (`write_optimizer`,
under `written_or_reset`: a failure puts a fresh optimizer back to fresh, and tells a stepped one that its state
is inconsistent and must be loaded again). Every trained parameter takes every step, one the backward missed with a
zero gradient (`stepped_params`), as under FSDP2 and Megatron."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from roll_algos.schedules import check_lr_schedule, lr_multiplier


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base LR at optimizer step `s`: linear warm-up, then constant, cosine or linear decay
    (roll_algos.schedules.lr_multiplier, the rule the driver's resume message reads too).

    An unknown `schedule` is a ValueError here: the multiplier read it only past the warm-up, so an engine built
    with a misspelt one trained through its warm-up and failed mid-run (or never, when the run was no longer than
    its warm-up)."""
    check_lr_schedule(schedule)

    def fn(step: int) -> float:
        return lr_multiplier(schedule, warmup_steps, total_steps, step)

    return fn


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay skips a parameter: biases and every parameter of fewer than 2 dimensions (LayerNorm /
    RMSNorm weights, scalar gates). Matrices decay: linear and embedding weights, LoRA's A and B. The rule of
    Megatron-Core's standard overrides (`len(param.shape) == 1 or name.endswith(".bias")`), which HF Trainer's
    (biases and norm layers by name) and torchtune's agree with on transformer models."""
    return param.ndim < 2 or name.endswith(".bias")


def param_groups(
    model: torch.nn.Module, weight_decay: float, decay_norms_and_biases: bool = False
) -> list[dict[str, Any]]:
    """AdamW param groups of `model`'s trainable parameters: [matrices at `weight_decay`, `no_decay` ones at 0]
    (`decay_norms_and_biases=True`: both at `weight_decay`). Decaying a norm's gain pulls it towards 0, i.e. shrinks
    the layer's output scale, which no gradient asked for. The groups' layout depends on the model alone, never on
    the settings (a resume with other settings loads the same optimizer structure); an empty group is left out."""
    decay, skip = [], []
    for name, p in model.named_parameters():  # tied parameters once
        if p.requires_grad:
            (skip if no_decay(name, p) else decay).append(p)
    rates = (weight_decay, weight_decay if decay_norms_and_biases else 0.0)
    return [{"params": ps, "weight_decay": wd} for ps, wd in zip((decay, skip), rates) if ps]


def stepped_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter `optimizer` trains (a tied one once), each given a zero gradient where the step's backward
    never reached it (a vision-language model's vision tower in a step without pictures, an MoE expert no token
    was routed to), for the gradient clipping and the step that follow.

    torch's AdamW skips a parameter whose gradient is None: no weight decay, no momentum, no step count. FSDP2's
    reduce-scatter hands such a parameter zeros (the fsdp2 engine asks it to for vision models) and Megatron's
    gradient buffers always hold one, so there AdamW decays it and its moments carry on; the hf engine alone left
    it untouched, and a text-only step of a vision-language model at weight decay 0.1 moved the vision tower by
    up to 8.5e-5 on fsdp2 and not at all on hf. With the zeros every engine steps every trained parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return params


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's fused kernel where torch has one for the parameters' device (CPU, CUDA, XPU, MPS), else its default.

    On CPU torch's default is the per-tensor loop: measured 0.58 s per step for a 135M-parameter fp32 model on a
    2-core machine, 0.14 s with `foreach`, 0.037 s fused (same update up to float reassociation)."""
    devices = {p.device.type for p in params}
    fusable = bool(params) and devices <= {"cpu", "cuda", "xpu", "mps"} and all(p.is_floating_point() for p in params)
    return {"fused": True} if fusable else {}  # FSDP2's DTensor parameters too (tested on CPU over gloo)


def optimizer_state_mb(optimizer: torch.optim.Optimizer) -> float:
    """MiB of the tensors in `optimizer`'s state on this rank (AdamW's moments and steps; a shard of them under
    FSDP2)."""
    return (
        sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t))
        / 2**20
    )


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Write the optimizer's state to `folder` (collective on sharded engines: every rank writes its shard)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fresh = not optimizer.state  # no step taken yet
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    if fresh:
        # DCP builds a never-stepped optimizer's state by stepping it once at lr 0 with zero gradients: Adam's step
        # count became 1 with zero moments, on the live optimizer and in the checkpoint, so the first real update
        # (of this run, or of one resumed from here) took step 2's bias corrections (~25% smaller on the tiny
        # model). Step 0 with zero moments is exactly a fresh Adam's state.
        for st in [*optimizer.state.values(), *state["optimizer"].get("state", {}).values()]:
            if torch.is_tensor(st.get("step")):
                st["step"].zero_()
            elif "step" in st:
                st["step"] = 0
    with _single_process_dcp():
        dcp.save(state, checkpoint_id=folder, no_dist=not _distributed())


def read_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> dict[str, Any]:
    """Read what `save_optimizer` wrote, resharded to this engine's layout (collective on sharded engines), for
    `write_optimizer`. A read that fails (a missing or truncated shard) raises and leaves the optimizer's state as it
    was. A fresh optimizer (no step yet: a resume's) is read in place, into the zeros DCP primes its state with; a
    stepped one's moments into copies, so its own state is intact until `write_optimizer`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # The template has this run's sharding; DCP reshards the saved state into it. Adam's per-parameter state
    # (keyed by parameter name) alone: the groups' hyperparameters are this run's anyway (the engine reapplies them,
    # roll_engines.train._settings), and the groups' layout may differ from the checkpoint's (checkpoints written
    # before biases and norms got their own no-decay group hold one group: DCP failed on the missing second one).
    fresh = not optimizer.state  # (a resume's engine: no step yet)
    template = get_optimizer_state_dict(model, optimizer)  # (DCP fills a fresh optimizer's state: zeros)
    # DCP reads into the template's tensors, which are the live moments: a read failing half-way left some of
    # them loaded. A stepped optimizer's are read into copies (a moment of twice its state); a fresh one's live
    # zeros are dropped again on failure, which leaves it fresh.
    own = template["state"]
    staged = own if fresh else {k: {n: _like(v) for n, v in st.items()} for k, st in own.items()}
    state = {"optimizer": {"state": staged}}
    try:
        with _single_process_dcp():
            dcp.load(state, checkpoint_id=folder, no_dist=not _distributed())
    except BaseException:  # (DCP's CheckpointException is no Exception)
        if fresh:
            optimizer.state.clear()
        raise
    return {"state": state["optimizer"]["state"], "param_groups": template["param_groups"]}


def write_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Write `read_optimizer`'s state into the optimizer (run it under `written_or_reset`: a failure here may leave
    the optimizer's state partly the checkpoint's)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, loaded)


@contextlib.contextmanager
def written_or_reset(optimizer: torch.optim.Optimizer, fresh: bool, small: Sequence[Any] = ()) -> Iterator[None]:
    """Around writing a load once its read succeeded (`write_optimizer`, the weights, the scheduler, the scaler):
    if the body fails, a `fresh` optimizer (no state before `read_optimizer`, which read into its own primed zeros:
    FSDP2's DTensor shards alike) is put back to fresh, as a failed read leaves it: no state, its param groups'
    hyperparameters as they were, and `small` (objects with `state_dict`/`load_state_dict`: the scheduler, the
    grad scaler) as they were; the error is raised unchanged. A stepped optimizer's state was overwritten with no
    copy kept (one would raise a load's peak memory by the optimizer's state): its error is a RuntimeError from the
    cause that says the state is no longer the engine's and a checkpoint must be loaded again, lest training go on
    from the checkpoint's moments beside the engine's own weights and schedule position (megatron's rule:
    roll_engines.train.megatron._checkpoint.written_or_reset). An interrupt (no Exception) is raised unchanged."""
    groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]
    kept = [(o, copy.deepcopy(o.state_dict())) for o in small] if fresh else []
    try:
        yield
    except BaseException as e:
        if fresh:
            optimizer.state.clear()
            for group, hyper in zip(optimizer.param_groups, groups):
                group.update(hyper)
            for o, state in kept:
                o.load_state_dict(state)
            raise
        if not isinstance(e, Exception):  # (an interrupt stays one)
            raise
        raise RuntimeError(
            f"writing the checkpoint's optimizer state and weights failed ({type(e).__name__}: {e}): the engine's "
            "optimizer state is now inconsistent, partly or wholly the checkpoint's beside the engine's own weights "
            "and step; load a checkpoint again before training on"
        ) from e


def _like(value: Any) -> Any:
    """A tensor's uninitialised copy (same sharding), to read into; anything else as it is."""
    return torch.empty_like(value) if torch.is_tensor(value) else value


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process whenever no process group exists, even when told so (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
