"""The dtypes a train engine holds and computes in (`engine_dtypes`), and how a frozen model (the reference policy,
a distillation teacher) holds its weights so that its forward computes exactly what the trainable actor's does at
the same weights (`mirror_autocast`, `hold_as_autocast_casts`).

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
  and, with bf16 compute, the stacked weights of MoE experts (below);
- in `param_dtype` (fp32): everything else (embeddings, norms, biases, routers, and parameters of other modules:
  convolutions, which cost memory but are never wrong);

and runs its forward under the same autocast as the actor. A cast to bf16 rounds to nearest, so the stored bf16
weight equals autocast's per-forward cast of the fp32 one, and every op sees the operands the actor's sees: the
log-probs are equal bit for bit (tested on the tiny models, tied and untied). Biases are cast by autocast too (they
could be bf16); they are few, and kept. Memory (parameter bytes): the linear weights, most of a dense model, take
half; the embedding (and a head tied to it) and the norms stay fp32. builtin:tiny: 203,136 bytes against 189,824
all-bf16 and 379,648 fp32 (+7%); by arithmetic, SmolLM2-135M (tied, 28M-parameter embedding) +21% over all-bf16,
a 7-8B model with an untied 0.5B-parameter embedding +7% (about 1 GB).

MoE experts (`mirror_autocast`): transformers 5 stores a layer's experts as one tensor per projection, all experts
stacked (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I): the modules its `use_experts_implementation` decorates,
Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, GPT-OSS, ...), not as `nn.Linear`s. Its default implementation,
`grouped_mm`, is not on autocast's list (pytorch#174763) and casts the input to the weight's dtype: fp32 masters ran
every expert in fp32 while the rest of the model ran in bf16 (and the fsdp2 engine's experts in bf16). So, in every
model of an autocasting engine, the actor's as a frozen one's, an experts module's 3-D weights are cast to the
compute dtype on entry to its forward whenever autocast to bf16 is on (a pre-hook shadows them by their casts for
that forward only; the `eager` (F.linear per expert) and `batched_mm` (bmm) implementations cast them anyway, so
only `grouped_mm` changes: its experts now compute in bf16 like every other matmul). Every use of those weights is
then a rounding to bf16, so a frozen model holds them in bf16 and stays exact (tested: Qwen3-MoE, Mixtral, OLMoE
through the engine; Qwen3-MoE in each implementation). Their biases (GPT-OSS: (E, out), added after the matmul)
and the routers (a `weight` (E, H) read by F.linear, small; DeepSeek-V3 and GLM-4.5 keep theirs fp32 by design)
stay in `param_dtype`. fp16 compute leaves the experts as they were (fp32; grouped_mm's fp16 support is not
assumed). Saving, by arithmetic: Qwen3-30B-A3B's experts are 29.0B of its 30.5B parameters; its reference takes
~62 GB (51% of fp32) instead of ~120 GB with fp32 experts.

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


#: Attributes transformers' `use_experts_implementation` sets on the experts modules it decorates.
_EXPERTS_MARKS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "_is_expert_parallel")


def stacked_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, tuple[str, ...]]]:
    """transformers' experts modules of `model` (`use_experts_implementation`) with the names of their stacked
    matmul weights: their own 3-D floating parameters ((E, out, in) or transposed; biases are 2-D)."""
    found = []
    for module in model.modules():
        if all(hasattr(module, mark) for mark in _EXPERTS_MARKS):
            own = module.named_parameters(recurse=False)
            names = tuple(name for name, p in own if p.dim() == 3 and p.is_floating_point())
            if names:
                found.append((module, names))
    return found


def _cast_on_entry(module: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook: under autocast to bf16, shadow the stacked expert weights by their bf16 casts (an instance
    attribute wins over `nn.Module.__getattr__`'s parameter; `named_parameters` still gives the masters, and the
    cast is differentiable: gradients reach them)."""
    names = module._roll_stacked  # (set by mirror_autocast)
    device = module._parameters[names[0]].device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16:
        for name in names:
            module.__dict__[name] = module._parameters[name].to(torch.bfloat16)


def _uncast_on_exit(module: torch.nn.Module, args: tuple, output: object) -> None:
    """Forward hook (run on an exception too): drop the shadows, whose values a later step would make stale."""
    for name in module._roll_stacked:
        module.__dict__.pop(name, None)


def mirror_autocast(model: torch.nn.Module, compute_dtype: torch.dtype, frozen: bool) -> int:
    """Make `model` (of an engine that autocasts from fp32 masters to `compute_dtype`) compute its stacked MoE experts
    in bf16 under bf16 autocast, as its linears do (see the module docstring), and, if `frozen`, hold what autocast
    and that cast round in `compute_dtype` (`hold_as_autocast_casts`). Returns the number of experts modules."""
    experts = stacked_experts(model)
    for module, names in experts:
        if getattr(module, "_roll_stacked", None) is None:  # (once: a second pair of hooks would change nothing)
            module._roll_stacked = names
            module.register_forward_pre_hook(_cast_on_entry)
            module.register_forward_hook(_uncast_on_exit, always_call=True)
    if frozen:
        hold_as_autocast_casts(model, compute_dtype)
    return len(experts)


def hold_as_autocast_casts(model: torch.nn.Module, compute_dtype: torch.dtype) -> tuple[int, int]:
    """Cast, in place, the parameters of `model` that autocast to `compute_dtype` casts at every use (see the module
    docstring) to `compute_dtype`; the rest keep their dtype. Stacked expert weights count with bf16 compute: the
    caller must have `mirror_autocast`'s cast on entry on the actor (it does on both). Returns the parameter bytes
    (before, after)."""
    kinds = _autocast_kinds()
    stacked = set()
    if compute_dtype == torch.bfloat16:
        stacked = {id(getattr(m, n)) for m, names in stacked_experts(model) for n in names}
    owners: dict[int, list[bool]] = {}  # id(parameter) -> for each use: is it a cast-anyway matmul weight?
    params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():  # (each module once; a shared parameter is seen through every owner)
        for name, p in module.named_parameters(recurse=False):
            linear = type(module) in kinds and name == "weight"
            owners.setdefault(id(p), []).append(linear or id(p) in stacked)
            params[id(p)] = p
    before = sum(p.numel() * p.element_size() for p in params.values())
    for key, uses in owners.items():
        p = params[key]
        if all(uses) and p.is_floating_point() and p.dtype.itemsize > compute_dtype.itemsize:
            p.data = p.data.to(compute_dtype)
    after = sum(p.numel() * p.element_size() for p in params.values())
    log.info(
        "frozen model: linear and expert weights in %s, the rest as loaded: %.1f MB of parameters (%.1f MB as loaded)",
        str(compute_dtype).removeprefix("torch."),
        after / 2**20,
        before / 2**20,
    )
    return before, after
