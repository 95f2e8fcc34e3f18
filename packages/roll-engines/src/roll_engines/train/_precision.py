"""The dtypes a train engine holds and computes in (`engine_dtypes`), and how a frozen model (the reference policy,
a distillation teacher) holds its weights so that its forward computes exactly what the trainable actor's does at
the same weights (`hold_as_autocast_casts`).

Trainable engines keep their parameters (and so AdamW's state) in `param_dtype`, fp32 by default: at lr 1e-6 most
bf16 updates would round to nothing. `param_dtype=float16` cannot train (its updates underflow) and master weights
narrower than the compute dtype are refused (autocast cannot widen: everything would run in the narrower one).

Frozen models: the `hf` engine trains fp32 master weights (`param_dtype`) under `torch.autocast` to the compute dtype
(`model.dtype`). Autocast casts the operands of matmul-like ops (linear, addmm, bmm, sdpa, ...) to the compute dtype
and leaves the rest (embeddings, norms, softmax, residual adds) in the weights' dtype. A frozen model held wholly in
the compute dtype ran those too in bf16: at step 0 (identical weights) its log-probs differed from the actor's by
~1e-3 per token on the tiny model (a DPO margin and an RL KL penalty that were not 0 at step 0, growing with model
size and length). So a frozen engine of an autocasting engine holds:

- in the compute dtype: the weights autocast casts anyway, `weight` of every plain `nn.Linear` and of transformers'
  `Conv1D` (GPT-2: `addmm(bias, x, weight)`, also cast), unless the same parameter is also used by a module of
  another kind (a tied LM head shares the embedding, which runs in its stored dtype: it stays in `param_dtype`);
- in `param_dtype` (fp32): everything else (embeddings, norms, biases, and parameters of other modules: MoE experts
  stacked in one tensor, convolutions, which cost memory but are never wrong);

and runs its forward under the same autocast as the actor. A cast to bf16 rounds to nearest, so the stored bf16
weight equals autocast's per-forward cast of the fp32 one, and every op sees the operands the actor's sees: the
log-probs are equal bit for bit (tested on the tiny models, tied and untied). Biases are cast by autocast too (they
could be bf16); they are few, and kept. Memory (parameter bytes): the linear weights, most of a dense model, take
half; the embedding (and a head tied to it) and the norms stay fp32. builtin:tiny: 203,136 bytes against 189,824
all-bf16 and 379,648 fp32 (+7%); by arithmetic, SmolLM2-135M (tied, 28M-parameter embedding) +21% over all-bf16,
a 7-8B model with an untied 0.5B-parameter embedding +7% (about 1 GB).

Not covered (held wholly in the compute dtype as before, `engine_dtypes`): a pure low-precision run
(`param_dtype` as narrow as the compute dtype: no autocast on either side), and the `fsdp2` engine, whose
mixed-precision policy casts every parameter (norms and embeddings too) to the compute dtype for the forward of the
actor and the reference alike, which therefore already agree. Loading reads the checkpoint in `param_dtype` first
(host memory peaks at the actor's size for the moment of the cast; the device never holds more than the result).
"""

from __future__ import annotations

import logging

import torch

from roll_core.models import torch_dtype

log = logging.getLogger(__name__)


def _autocast_kinds() -> tuple[type, ...]:
    """Modules whose `weight` is only ever an operand of an op autocast casts."""
    kinds: tuple[type, ...] = (torch.nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # (an older transformers without it: no GPT-2 Conv1D to cover)
        return kinds
    return (*kinds, Conv1D)


def engine_dtypes(dtype: str, param_dtype: str, trainable: bool, autocasts: bool) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, dtype the weights are loaded in) of an engine computing in `dtype` (model.dtype) with master
    weights in `param_dtype`. A frozen engine (not `trainable`) needs no master copy: it loads in `param_dtype` where
    the engine `autocasts` from it to a narrower compute dtype (`hold_as_autocast_casts` then narrows the linear
    weights), else in the compute dtype (pure low precision, or an engine whose own policy casts every parameter).

    Raises:
        ValueError: a trainable engine with `param_dtype=float16`, or with masters narrower than the compute dtype.
    """
    compute, master = torch_dtype(dtype), torch_dtype(param_dtype)
    if not trainable:  # (a frozen reference or teacher may hold fp16 weights)
        return compute, master if autocasts and master.itemsize > compute.itemsize else compute
    if master == torch.float16:
        raise ValueError("param_dtype=float16 cannot train (updates underflow): keep float32 master weights")
    if master.itemsize < compute.itemsize:  # dtype=auto may resolve to fp32 here
        raise ValueError(
            f"param_dtype={param_dtype} is narrower than the compute dtype ({dtype} -> {compute}): "
            "autocast cannot widen, so everything would run in the narrower one; use float32 master weights"
        )
    return compute, master


def hold_as_autocast_casts(model: torch.nn.Module, compute_dtype: torch.dtype) -> tuple[int, int]:
    """Cast, in place, the parameters of `model` that autocast to `compute_dtype` casts at every use (see the module
    docstring) to `compute_dtype`; the rest keep their dtype. Returns the parameter bytes (before, after)."""
    kinds = _autocast_kinds()
    owners: dict[int, list[bool]] = {}  # id(parameter) -> for each use: is it a cast-anyway linear weight?
    params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():  # (each module once; a shared parameter is seen through every owner)
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(type(module) in kinds and name == "weight")
            params[id(p)] = p
    before = sum(p.numel() * p.element_size() for p in params.values())
    for key, uses in owners.items():
        p = params[key]
        if all(uses) and p.is_floating_point() and p.dtype.itemsize > compute_dtype.itemsize:
            p.data = p.data.to(compute_dtype)
    after = sum(p.numel() * p.element_size() for p in params.values())
    log.info(
        "frozen model: linear weights in %s, the rest as loaded: %.1f MB of parameters (%.1f MB as loaded)",
        str(compute_dtype).removeprefix("torch."),
        after / 2**20,
        before / 2**20,
    )
    return before, after
