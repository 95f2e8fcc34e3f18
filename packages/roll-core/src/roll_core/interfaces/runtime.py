"""The engine constructor contract: what a worker passes to an engine's constructor besides the engine's own config.

An engine is built as `Engine(**config_keys, **runtime)` (roll_core.cluster.engine_worker.build_engine):
- `config_keys` are the fields of its `train_engine` / `infer_engine` schema (roll_core.config.schema.
  TrainEngineConfig / InferEngineConfig and the engine's subclass), less the keys the worker reads itself
  (roll_core.cluster.engine_worker.WORKER_KEYS);
- `runtime` are the run's values that live in other config groups (model path and dtype, seed, the optimizer
  schedule of this role), typed below. Roles build them in one place (roll_core.pipelines.wiring.build_roles).

Contract: an engine constructor accepts every key of its runtime type (it may ignore one it has no use for, e.g.
`attn_implementation` in an engine with its own attention, but says so in a comment) and every field of its
config schema, and names no catch-all `**kwargs`: a key it does not know is an error at build time
(`check_engine_kwargs`), never silently dropped. The exception are the runtime keys added after plugin engines were
written against the contract (`OPTIONAL_RUNTIME_KEYS`): an engine whose constructor does not take one is built
without it (`supported_runtime`), and what it then cannot do is logged once; roll's own engines take them all.
The roles' runtime (build_roles) shares no key with the engine config; tools and tests may pass further
constructor keys (`dist_backend`) or override a config key (on a clash the runtime wins,
roll_core.config.build.build).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict

log = logging.getLogger(__name__)


class EngineRuntime(TypedDict):
    """Run values every engine receives."""

    #: Local folder of the model (roll_core.models.resolve_model_path also takes hub ids and `builtin:` names).
    model_path: str
    #: Compute dtype of the weights (model.dtype, or infer_engine.dtype for inference), resolved on the engine's node.
    dtype: str
    #: transformers attention implementation (model.attn_implementation); engines with their own kernels ignore it.
    attn_implementation: str
    #: Passed to transformers' from_pretrained (model.trust_remote_code).
    trust_remote_code: bool
    #: pipeline.seed: initialisation of new heads, engine-internal sampling streams.
    seed: int
    #: torch device string ("cpu", "cuda:0"); the driver sends "auto", resolved where the engine runs.
    device: str


class _Placement(TypedDict, total=False):
    #: Platform name for resolving `device` and `dtype` on the engine's node (roll_core.devices.resolve_device);
    #: read and removed by the worker, never passed to the engine.
    platform: str
    #: A vision-language run's picture size bounds (model.image_min_pixels / image_max_pixels), only those set
    #: (roll_core.multimodal.processor.engine_pixels): the engines that resize pictures (vLLM) or save an image
    #: processor with a checkpoint (hf, fsdp2) use them; the others take them unused.
    image_min_pixels: int
    image_max_pixels: int


class _TrainRole(EngineRuntime):
    role: Literal["actor", "critic", "reference"]


class TrainEngineRuntime(_TrainRole, _Placement, total=False):
    """Run values of a training engine: its role and, for trainable roles, the optimizer schedule (from `algo`)."""

    #: False for a frozen role (the reference policy): no optimizer, weights in the compute dtype.
    trainable: bool
    lr: float
    weight_decay: float
    warmup_steps: int
    #: Optimizer steps of the run (the LR schedule's horizon).
    total_steps: int
    #: Optimizer steps per training step (algo.ppo_epochs x mini-batches): a checkpoint records it with the schedule's
    #: count, and a resume with another number re-bases the count to as many training steps of its own plan.
    optimizer_steps_per_step: int
    lr_schedule: str
    max_grad_norm: float


class _InferLimits(EngineRuntime):
    #: Default response limit (model.max_response_length); SamplingParams may lower it per call.
    max_new_tokens: int


class InferEngineRuntime(_InferLimits, _Placement, total=False):
    """Run values of an inference engine."""

    #: infer_engine.lora_sync=adapter only: the trainer's LoRA rank; the engine serves adapters of this rank on its
    #: base, and every weight sync brings the adapter alone (engines that serve adapters take it).
    lora_rank: int


def _keys(t: Any) -> frozenset[str]:
    return frozenset(t.__required_keys__ | t.__optional_keys__)


#: Keys of each runtime type, for run-time checks (Python does not check TypedDicts).
TRAIN_RUNTIME_KEYS = _keys(TrainEngineRuntime)
INFER_RUNTIME_KEYS = _keys(InferEngineRuntime)

#: Runtime keys added after plugin engines were written against the runtime types, and what an engine that does not
#: take one cannot do: it is built without the key (`supported_runtime`), not refused (it was a TypeError at build).
OPTIONAL_RUNTIME_KEYS: dict[str, str] = {
    "optimizer_steps_per_step": (
        "cannot re-base its LR schedule on resume: a run resumed with another number of optimizer steps per "
        "training step (algo.num_mini_batches, algo.mini_batch_size, algo.ppo_epochs) goes on from the checkpoint's "
        "optimizer-step count, possibly at the schedule's end (LR 0); resume with the settings that saved it"
    ),
}

_said: set[tuple[str, str]] = set()  # (engine, key) pairs already logged: once per process


def accepted_keys(target: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword arguments `target` takes, or None when it ends in a catch-all `**kwargs`.

    A class's constructor with `**kwargs` is read as forwarding them to its base class's constructor (FSDP2's
    engine over hf's), whose names are then accepted too, along the MRO; a catch-all at the end of that chain (or
    in a plain function) swallows unknown keys and yields None.
    """
    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    chain: list[Callable[..., Any]] = [target]
    if isinstance(target, type):
        chain = [vars(c)["__init__"] for c in target.__mro__ if c is not object and "__init__" in vars(c)]
    names: set[str] = set()
    for fn in chain:
        params = inspect.signature(fn).parameters
        names |= {n for n, p in params.items() if p.kind not in var and n != "self"}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return frozenset(names)
    return None


def supported_runtime(target: Callable[..., Any], runtime: Mapping[str, Any]) -> dict[str, Any]:
    """`runtime` less the `OPTIONAL_RUNTIME_KEYS` that `target`'s constructor does not take, each logged (WARNING,
    once per engine and key in this process) with what the engine then cannot do. A constructor with a catch-all
    `**kwargs` gets `runtime` as it is (`check_engine_kwargs` refuses it); every other key stays (an unknown one is
    `check_engine_kwargs`'s error).

    Args:
        target: the engine class (or factory).
        runtime: the runtime keys meant for it.
    """
    accepted = accepted_keys(target)
    if accepted is None:
        return dict(runtime)
    name = getattr(target, "__qualname__", repr(target))
    kept = {}
    for key, value in runtime.items():
        if key in OPTIONAL_RUNTIME_KEYS and key not in accepted:
            if (name, key) not in _said:
                _said.add((name, key))
                log.warning("%s takes no runtime key %r: it %s", name, key, OPTIONAL_RUNTIME_KEYS[key])
            continue
        kept[key] = value
    return kept


def check_engine_kwargs(target: Callable[..., Any], config: Mapping[str, Any], runtime: Mapping[str, Any]) -> None:
    """Raise TypeError naming the engine and the keys when `target(**config, **runtime)` would break the contract
    (module docstring): a constructor that swallows unknown keys (`accepted_keys`), or a key it does not take.
    Nothing is built.

    Args:
        target: the engine class (or factory).
        config: the engine config's keys passed to it (worker keys and `_target_` removed).
        runtime: the runtime keys passed to it (`platform` removed).
    """
    name = getattr(target, "__qualname__", repr(target))
    accepted = accepted_keys(target)
    if accepted is None:
        raise TypeError(
            f"{name} takes **kwargs: an engine constructor names every key it accepts (unknown keys are errors)"
        )
    for source, keys in (("config", config), ("runtime", runtime)):
        unknown = sorted(k for k in keys if k not in accepted)
        if unknown:
            raise TypeError(
                f"{name} does not accept the {source} key(s) {unknown}"
                + (": remove them from the engine's config" if source == "config" else "")
            )
