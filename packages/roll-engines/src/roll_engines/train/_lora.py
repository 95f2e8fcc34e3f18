"""LoRA adapters (peft) for the transformers-based training engines.

Contract: with `lora_rank > 0` only the adapters train (AdamW holds state for them alone); the frozen base with
adapters disabled is the reference policy (no second model copy); weight sync and the `model/` checkpoint folder
carry merged weights in the base model's HF names (W + scaling * B @ A), so inference engines and plain
transformers need no LoRA support; `adapter/` holds the adapter in peft's format (PeftModel.from_pretrained).
An inference engine that serves adapters itself (vLLM, `infer_engine.lora_sync=adapter`) is synced with
`adapter_weights` instead: the adapter alone, in peft's saved names, with the scaling folded into B.
On a vision-language model, "all-linear" adapts the language model's linear layers only. Every entry of a
target list must adapt some layer (a misspelt one is a ConfigError); an untied embedding may carry an adapter
(merged like a linear layer's; an adapter-serving engine refuses it), and so may a convolution. A resume
(`load_adapter`) refuses an adapter saved with another rank or alpha.

Functions take a `full` callable that turns a (possibly sharded, FSDP2 DTensor) tensor into a full one, so the
same code serves the hf and fsdp2 engines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ADAPTER = "default"
#: Module names of a vision-language model's vision side (Qwen-VL `visual`, LLaVA `vision_tower` and projector).
VISION_MODULES = r".*\b(visual|vision_tower|multi_modal_projector)\b.*"


def apply_lora(
    model: torch.nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str] | str,
    adapter_dtype: torch.dtype | None = None,
) -> Any:
    """Wrap `model` with LoRA adapters on `targets` (peft names, or "all-linear": every linear layer but the head).

    The base keeps the dtype it was loaded in (the engines load it in the compute dtype: it is frozen); the adapters,
    the only trained parameters, are held in `adapter_dtype` (the engine's param_dtype, fp32 by default: AdamW's
    updates at small learning rates round away in bf16), whatever peft would pick from the base's dtype."""
    from roll_engines.config import PEFT

    PEFT.require()
    from peft import LoraConfig, get_peft_model

    # A vision-language model's "all-linear" is its language model's: the vision tower and projector stay frozen
    # (as peers train VLM policies), and the merged weights change only the decoder.
    vision = targets == "all-linear" and getattr(model.config, "vision_config", None) is not None
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        exclude_modules=VISION_MODULES if vision else None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    import warnings

    with warnings.catch_warnings():  # peft 0.21 still asks transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # peft's warning about a tied layer in the adapter: refused just below, with what to change
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*tied layer.*", category=UserWarning)
        peft_model = get_peft_model(model, config)
    refuse_unmatched_targets(targets, peft_model.targeted_module_names)
    refuse_tied_targets(peft_model)
    if adapter_dtype is not None:
        for p in peft_model.parameters():
            if p.requires_grad:  # before any optimizer holds them: swapping the storage is safe here
                p.data = p.data.to(adapter_dtype)
    return peft_model


def refuse_unmatched_targets(targets: list[str] | str, adapted: list[str]) -> None:
    """ConfigError for an entry of a target list that matched no module (peft's rule: the module's name, or its
    name's last dotted parts): peft refuses only a list that matches nothing at all, so a misspelt entry beside a
    correct one (["q_proj", "v_prj"]) trained without the adapters it asked for. A string ("all-linear", a regex)
    is peft's to check."""
    from roll_core.errors import ConfigError

    if isinstance(targets, str):
        return
    unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in adapted)]
    if unmatched:
        raise ConfigError(
            f"train_engine.lora_target_modules: {unmatched} match no layer of the model (adapted: "
            f"{sorted({n.rsplit('.', 1)[-1] for n in adapted})}); fix or remove them"
        )


def refuse_tied_targets(model: torch.nn.Module) -> None:
    """ConfigError for an adapter on a layer whose weight another module shares (the LM head of a model with tied
    embeddings, or the embedding itself): the merged weight would have to be both layers' at once, so weight sync
    and the `model/` checkpoint, which carry the shared tensor once under the embedding's name, would silently
    leave the adapter out (the engines would sample from a policy without it)."""
    from peft.tuners.lora import LoraLayer

    from roll_core.errors import ConfigError

    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append(f"{name}.{pname}")
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        weight = getattr(module.get_base_layer(), "weight", None)
        shared = [h for h in holders.get(id(weight), []) if not h.startswith(f"{name}.")] if weight is not None else []
        if shared:
            raise ConfigError(
                f"train_engine.lora_target_modules adapts {name.split('base_model.model.', 1)[-1]}, whose weight is "
                f"tied to {shared[0].split('base_model.model.', 1)[-1]} (tie_word_embeddings): an adapter there "
                "cannot be synced or saved as merged weights; leave the head and embeddings out of the targets"
            )


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (with the LoRA layers injected), else the model itself."""
    return model.get_base_model() if is_lora(model) else model


def merged_weights(
    model: torch.nn.Module, full: Callable[[Tensor], Tensor], changed_only: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """(HF name, merged full tensor) for every base parameter and persistent buffer; tied tensors once.

    `changed_only`: the weights that carry an adapter (the only ones training changes) and the other parameters of
    the modules that hold them (`sync_parents`): an engine that loads fused layers whole (vLLM's q|k|v and gate|up,
    reloaded layer by layer) would otherwise refill the parts not sent from uninitialised memory.
    """
    from peft.tuners.lora import LoraLayer

    base = base_model(model)
    lora_modules = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    persistent = set(base.state_dict())
    parents = sync_parents(f"{owner}.weight" for owner, m in lora_modules.items() if is_linear(m.get_base_layer()))
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        hf_name = name.replace(".base_layer.", ".")
        if owner is not None and owner in lora_modules and name.endswith(".weight"):
            w = full(p.detach())
            # Summed in fp32, rounded once to the base's dtype (a bf16 base: rounding the delta first lost bits twice).
            yield hf_name, (w.float() + _delta(lora_modules[owner], full).float()).to(w.dtype)
        elif not changed_only or in_parents(hf_name, parents):
            yield hf_name, full(p.detach())
    if changed_only:
        return
    for name, b in base.named_buffers():
        if name in persistent:
            yield name.replace(".base_layer.", "."), full(b)


def _delta(module: Any, full: Callable[[Tensor], Tensor]) -> Tensor:
    """scaling * B @ A of a LoRA layer, shaped as its base weight: a linear layer's (out, in) (transposed for
    GPT-2's Conv1D, `fan_in_fan_out`), an embedding's (num_embeddings, dim) from peft's lora_embedding_A (r, num)
    and lora_embedding_B (dim, r) (a target list naming an untied embedding: the merge raised KeyError, at the first
    weight sync or save after training had started)."""
    if ADAPTER in getattr(module, "lora_embedding_A", {}):
        a = full(module.lora_embedding_A[ADAPTER].detach())
        b = full(module.lora_embedding_B[ADAPTER].detach())
        return (b @ a).T * module.scaling[ADAPTER]
    a = full(module.lora_A[ADAPTER].weight.detach())
    b = full(module.lora_B[ADAPTER].weight.detach())
    if a.dim() > 2:
        if getattr(module.get_base_layer(), "groups", 1) != 1:  # (peft cannot merge those either)
            raise ValueError("an adapter on a grouped convolution cannot be merged: leave it out of the targets")
        # A convolution's adapter (a target list naming one, e.g. "proj" reaching Qwen2.5-VL's patch embedding, a
        # Conv3d): A is a conv of the base's kernel (r, in, *k), B a 1x1 conv (out, r, 1...); `b @ a` on those
        # raised at the first weight sync or save after training had started. B @ A over the flattened kernel.
        return (b.flatten(1) @ a.flatten(1)).view(b.shape[0], *a.shape[1:]) * module.scaling[ADAPTER]
    delta = (b @ a) * module.scaling[ADAPTER]
    return delta.T if getattr(module, "fan_in_fan_out", False) else delta


def is_linear(module: torch.nn.Module) -> bool:
    """A linear layer: torch's, or transformers' `Conv1D` (GPT-2's fused q|k|v `c_attn`, whose weight is stored
    transposed). Changed-only syncs found their fused groups (`sync_parents`) from torch's alone, so a GPT-2
    adapter's sync sent `c_attn.weight` without `c_attn.bias`, the gap `sync_parents` closes for vLLM's layers."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, torch.nn.Linear | Conv1D)


def sync_parents(changed: Iterable[str]) -> set[str]:
    """The modules two levels up from changed linear weights ("model.layers.0.self_attn" for
    "model.layers.0.self_attn.q_proj.weight"): a changed-only sync sends every parameter directly under them
    (`in_parents`), so fused groups (q|k|v, gate|up) reach an engine whole. Pass linear layers' weights only: an
    embedding's parent is the whole model's top module."""
    return {name.rsplit(".", 2)[0] for name in changed if name.count(".") >= 2}


def in_parents(name: str, parents: set[str]) -> bool:
    """Whether parameter `name` sits directly in a module of `parents` (see `sync_parents`)."""
    return name.count(".") >= 2 and name.rsplit(".", 2)[0] in parents


def adapter_weights(model: torch.nn.Module, full: Callable[[Tensor], Tensor]) -> Iterator[tuple[str, Tensor]]:
    """(peft saved name, full tensor) of every adapter matrix: `<module>.lora_A.weight` [r, in] and
    `<module>.lora_B.weight` [out, r] with B already multiplied by the layer's scaling (alpha / r), so a receiver
    serves the adapter with scaling 1 (lora_alpha = r) and needs no other setting. Collective on sharded engines.
    ConfigError, before the first tensor, for an adapter `refuse_unservable` refuses."""
    refuse_unservable(model)
    from peft.tuners.lora import LoraLayer

    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer) or ADAPTER not in m.lora_A:
            continue
        a = full(m.lora_A[ADAPTER].weight.detach())
        b = full(m.lora_B[ADAPTER].weight.detach())
        yield f"{name}.lora_A.weight", a
        yield f"{name}.lora_B.weight", b * m.scaling[ADAPTER]


def refuse_unservable(model: torch.nn.Module) -> None:
    """ConfigError for adapted layers an adapter-serving engine (infer_engine.lora_sync=adapter) cannot take:
    embedding and convolution adapters, and any adapter on a vision-language model's vision side (vLLM serves LoRA on
    the language model only, and dropped a vision tower's adapters silently, so its rollouts came from another policy
    than the trainer's). The config check (roll_core.config.lora_sync) refuses only the targets it can read off the
    names; a regex that reaches an embedding without naming it (".*(q_proj|_tokens)") is seen here, on the model:
    the engines call this when the run's weight sync is set up (`check_adapter_sync`, TrainWorker.
    set_weight_format), before the first rollout, not at the first sync after a rollout and a training step."""
    import re

    from peft.tuners.lora import LoraLayer

    from roll_core.errors import ConfigError

    adapted = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    vision = [n for n, _ in adapted if re.fullmatch(VISION_MODULES, n)]
    if vision:
        raise ConfigError(
            f"{len(vision)} adapted layers are on the vision side ({', '.join(vision[:3])}"
            f"{', ...' if len(vision) > 3 else ''}): infer_engine.lora_sync=adapter serves the language model's "
            "adapters only (vLLM would drop these silently). Target the language model alone "
            "(train_engine.lora_target_modules=all-linear, which leaves the vision tower out, or a regex that "
            "excludes visual/vision_tower/multi_modal_projector), or use infer_engine.lora_sync=merged"
        )
    refused = [f"{n.split('base_model.model.', 1)[-1]} ({kind})" for n, m in adapted if (kind := _unservable(m))]
    if refused:
        raise ConfigError(
            f"train_engine.lora_target_modules adapts {', '.join(refused[:3])}{', ...' if len(refused) > 3 else ''}: "
            "an inference engine serves LoRA on linear layers, not on embeddings or convolutions; narrow the targets "
            "to leave them out, or use infer_engine.lora_sync=merged"
        )


def _unservable(module: Any) -> str | None:
    """What an adapter-serving engine cannot take of this LoRA layer ("an embedding", "a convolution"), or None."""
    if ADAPTER in getattr(module, "lora_embedding_A", {}):
        return "an embedding"
    if ADAPTER in module.lora_A and module.lora_A[ADAPTER].weight.dim() != 2:
        return "a convolution"
    return None


def check_adapter_sync(engine: Any) -> None:
    """What an engine's `check_adapter_sync` runs (TrainWorker.set_weight_format, before the first rollout): the
    ValueError `iter_adapter` would raise at the first sync, raised now."""
    if not getattr(engine, "lora", False):
        raise ValueError(f"{engine.name} engine: adapter weight sync needs LoRA (train_engine.lora_rank > 0)")
    refuse_unservable(engine.model)


def adapter_state(model: torch.nn.Module, full: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """The adapter's tensors in peft's saved names (full, CPU)."""
    from peft import get_peft_model_state_dict

    # The base (embeddings included) never trains: the adapter alone is saved, even when lm_head has one.
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    return {k: full(v.detach()).cpu().contiguous() for k, v in state.items()}


def save_lora(
    model: torch.nn.Module,
    weights: Iterator[tuple[str, Tensor]],
    full: Callable[[Tensor], Tensor],
    writer: bool,
    folder: Path,
) -> None:
    """`folder/model` (the merged `weights` in HF names, which plain transformers loads: a vision-language model's
    included) and `folder/adapter` (peft format); collective on sharded engines, only the `writer` rank writes."""
    # Every rank walks the weights (each full tensor is a collective gather) but only the writer keeps host copies:
    # every rank holding the whole merged model took ranks x model size of host memory at each save.
    merged = {}
    for k, v in weights:
        if writer:
            merged[k] = v.detach().to("cpu", copy=True)
    adapter = adapter_state(model, full)
    if writer:
        base_model(model).save_pretrained(folder / "model", state_dict=merged, safe_serialization=True)
        save_adapter(model, adapter, folder / "adapter")


def save_adapter(model: torch.nn.Module, state: dict[str, Tensor], folder: Path) -> None:
    """Write peft's adapter folder (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model.peft_config[ADAPTER].save_pretrained(str(folder))
    save_file(state, str(folder / "adapter_model.safetensors"))


def load_adapter(model: torch.nn.Module, folder: Path) -> None:
    """Load adapter weights written by `save_adapter` into `model` (sharded parameters included)."""
    set_adapter(model, read_adapter(folder, model))


#: adapter_config.json fields that set what the adapter computes (its scaling, per-layer ranks and alphas).
_SCALING_FIELDS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern")


def read_adapter(folder: Path, model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapter tensors of a `save_adapter` folder, in peft's saved names (the fsdp2 engine reads them on rank 0
    only and broadcasts them). ValueError when the folder's adapter_config.json has another rank, alpha or scaling
    rule than `model`'s adapter: a resume with a changed lora_alpha loaded A and B under the new alpha / r and
    trained on from a policy that was never the saved one (a changed rank failed only on a tensor shape)."""
    import json

    from roll_engines.train._safetensors_file import read_safetensors

    saved = json.loads((folder / "adapter_config.json").read_text())
    ours = model.peft_config[ADAPTER].to_dict()
    differ = {k: (saved.get(k), ours.get(k)) for k in _SCALING_FIELDS if _norm(saved.get(k)) != _norm(ours.get(k))}
    if differ:
        raise ValueError(
            f"{folder}: the saved adapter differs from this run's in "
            + ", ".join(f"{k} (saved {a}, this run {b})" for k, (a, b) in differ.items())
            + ": resume with the saved train_engine.lora_rank and lora_alpha"
        )
    return read_safetensors(folder / "adapter_model.safetensors")


def _norm(value: Any) -> Any:
    """A config field for comparison: numbers as floats (alpha 16 == 16.0), absent == false == empty."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, int | float):
        return float(value)
    return value or False


def set_adapter(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Load `read_adapter`'s tensors into `model`'s adapters; RuntimeError for tensors the model has no place for,
    and for adapters of the model the tensors leave out (they would keep this run's fresh initialisation: a policy
    that was never the saved one)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    # The load is non-strict over the whole model: its missing keys hold every base weight; the adapters' own
    # (lora_A / lora_B / lora_embedding_*) are the ones the file had to bring.
    missing = [k for k in getattr(result, "missing_keys", []) or [] if ".lora_" in k]
    if unexpected or missing:
        parts = [f"{name} {keys[:5]}" for name, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise RuntimeError(f"adapter checkpoint mismatch: {'; '.join(parts)}")
