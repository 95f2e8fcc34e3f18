"""Megatron optimizer checkpoints on CPU and without Apex/TE: quiet dist_checkpointing calls and the workarounds that
let Megatron-Core 0.16's distributed optimizer resume correctly (`prime_optimizer_state`,
`torch_adam_steps_restored`), and the size of an optimizer's state (`optimizer_state_bytes`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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


def prime_optimizer_state(optimizer: Any) -> None:
    """Give a fresh optimizer zero moments and step 0, as a first step would: the distributed optimizer builds
    its loading template from its own state, and without Apex/TE it requires every parameter's `step`."""
    for opt in parts(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(
                        exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), step=torch.tensor(0.0)
                    )


@contextlib.contextmanager
def quiet_dist_checkpointing() -> Iterator[None]:
    """Megatron's dist_checkpointing calls torch APIs that torch deprecates (ShardedTensor, DCP's load_state_dict):
    their FutureWarnings are about Megatron's code, not the user's."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


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
