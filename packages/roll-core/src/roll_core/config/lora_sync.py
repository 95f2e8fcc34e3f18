"""`infer_engine.lora_sync`: whether a LoRA run's weight sync may send the adapter alone, checked before any worker
starts.

Contract: `adapter_rank(train_engine, infer_engine)` is the LoRA rank the inference engines must serve (passed to
them as the runtime key `lora_rank`): the trainer's `lora_rank` under `lora_sync=adapter`, 0 under `merged` (the
default: merged weights, which every engine takes). Adapter sync is a ConfigError, naming what to change, when
- the trainer has no adapter (`train_engine.lora_rank=0`) or cannot export it alone (its class lacks
  `adapter_sync`: Megatron's adapters are fused per tensor-parallel layer),
- the inference engine cannot serve adapters (its class lacks `lora_adapters`: hf, sglang), or not of this rank
  (above its class's `max_lora_rank`: vLLM's 512; it refused only when it started, after the trainer had loaded),
- the adapter targets layers an adapter-serving engine cannot take as LoRA (embeddings and the output head),
- `sleep_level=2`, which discards the engines' base weights, which adapter syncs never resend.
"""

from __future__ import annotations

import re
from typing import Any

from roll_core.errors import ConfigError

#: Module names of embeddings and output heads (Llama/Qwen, GPT-2, GPT-NeoX, Bloom, Megatron): never adapter-synced.
NOT_SERVABLE = ("lm_head", "embed_tokens", "wte", "wpe", "embed_in", "embed_out", "word_embeddings", "output_layer")


def refused_targets(targets: Any) -> list[str]:
    """The entries of `train_engine.lora_target_modules` that name an embedding or output head ("all-linear": none,
    peft leaves the head out). A string other than "all-linear" is peft's regex over module names."""
    if targets == "all-linear":
        return []
    if isinstance(targets, str):
        return [n for n in NOT_SERVABLE if re.search(rf"\b{n}\b", targets)]
    return [str(t) for t in targets if str(t).rsplit(".", 1)[-1] in NOT_SERVABLE]


def adapter_rank(train_engine: Any, infer_engine: Any) -> int:
    """The LoRA rank the inference engines serve (0: they take merged weights); ConfigError where adapter sync
    cannot work (module docstring)."""
    if getattr(infer_engine, "lora_sync", "merged") != "adapter":
        return 0
    from hydra.utils import get_object

    te, ie = train_engine, infer_engine
    if not te.lora_rank:
        raise ConfigError(
            "infer_engine.lora_sync=adapter sends the trainer's LoRA adapter alone: set train_engine.lora_rank > 0 "
            "(or infer_engine.lora_sync=merged)"
        )
    infer_cls = get_object(ie._target_)
    if not getattr(infer_cls, "lora_adapters", False):
        raise ConfigError(
            f"infer_engine={ie.name} cannot serve LoRA adapters: infer_engine.lora_sync=adapter needs "
            "infer_engine=vllm; with this engine use infer_engine.lora_sync=merged"
        )
    limit = getattr(infer_cls, "max_lora_rank", None)
    if limit is not None and te.lora_rank > limit:
        raise ConfigError(
            f"train_engine.lora_rank={te.lora_rank}: infer_engine={ie.name} serves LoRA adapters up to rank {limit}; "
            "lower train_engine.lora_rank, or use infer_engine.lora_sync=merged"
        )
    if not getattr(get_object(te._target_), "adapter_sync", False):
        raise ConfigError(
            f"train_engine={te.name} cannot export its LoRA adapter alone: infer_engine.lora_sync=adapter needs "
            "train_engine=hf or fsdp2; with this trainer use infer_engine.lora_sync=merged"
        )
    refused = refused_targets(te.lora_target_modules)
    if refused:
        raise ConfigError(
            f"train_engine.lora_target_modules names {refused}: an inference engine serves LoRA on linear layers, "
            "not on embeddings or the output head; drop them, or use infer_engine.lora_sync=merged"
        )
    if ie.sleep_level == 2:
        raise ConfigError(
            "infer_engine.sleep_level=2 discards the engines' base weights, which infer_engine.lora_sync=adapter "
            "never resends: use sleep_level 1 (or lora_sync=merged)"
        )
    return int(te.lora_rank)
