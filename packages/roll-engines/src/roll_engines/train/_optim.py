"""The `hf`/`fsdp2` engines' optimizer pieces: the LR schedule, AdamW's kernel choice and the optimizer-state
checkpoint (torch.distributed.checkpoint, keyed by parameter name, sharded by rank, resharded on load: a run
saved on N ranks resumes on M ranks or in one process). Saving an optimizer that has not stepped yet leaves its
next update unchanged (and so does resuming from that checkpoint)."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base LR at optimizer step `s`: linear warm-up, then constant, cosine or linear decay."""

    def fn(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant" or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if schedule == "linear":
            return 1.0 - progress
        raise ValueError(f"unknown lr schedule {schedule!r}")

    return fn


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's fused kernel where torch has one for the parameters' device (CPU, CUDA, XPU, MPS), else its default.

    On CPU torch's default is the per-tensor loop: measured 0.58 s per step for a 135M-parameter fp32 model on a
    2-core machine, 0.14 s with `foreach`, 0.037 s fused (same update up to float reassociation)."""
    devices = {p.device.type for p in params}
    fusable = bool(params) and devices <= {"cpu", "cuda", "xpu", "mps"} and all(p.is_floating_point() for p in params)
    return {"fused": True} if fusable else {}  # FSDP2's DTensor parameters too (tested on CPU over gloo)


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


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load what `save_optimizer` wrote, resharded to this engine's layout (collective on sharded engines)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # The template has this run's sharding; DCP reshards the saved state into it.
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with _single_process_dcp():
        dcp.load(state, checkpoint_id=folder, no_dist=not _distributed())
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process whenever no process group exists, even when told so (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
