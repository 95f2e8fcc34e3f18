"""Settings the `megatron` training engine refuses, checked before anything is built.

Contract: `refuse_unsupported` raises ValueError naming the key to change and what to use instead, for every setting
the engine would otherwise run wrongly or fail on deep inside Megatron-Core. The engine calls it first in its
constructor (the engine is also built directly, without the config schema's checks).
"""

from __future__ import annotations

from roll_core.models import torch_dtype


def refuse_unsupported(
    *,
    role: str,
    trust_remote_code: bool,
    dtype: str,
    param_dtype: str,
    trainable: bool,
    lora_rank: int,
    lora_dropout: float,
    micro_batch_tokens: int,
    pipeline_parallel_size: int,
    context_parallel_size: int,
) -> None:
    """Raise ValueError for a setting `MegatronTrainEngine` cannot run (arguments as the engine's constructor)."""
    import torch

    if context_parallel_size < 1:
        raise ValueError(f"context_parallel_size={context_parallel_size} must be >= 1")
    if trust_remote_code:
        raise ValueError(
            "train_engine=megatron maps transformers' own Llama/Qwen2/Qwen3 code to Megatron layers; a model with "
            "remote code (model.trust_remote_code=true) cannot be converted: use train_engine=hf or fsdp2"
        )
    if role not in ("actor", "reference", "critic"):
        raise ValueError(f"role must be actor, critic or reference, got {role!r}")
    if role == "critic" and lora_rank:
        raise ValueError("LoRA trains the policy only (role 'critic'): set lora_rank=0 for the critic")
    if lora_rank and lora_dropout:
        raise ValueError("train_engine=megatron trains LoRA without dropout: set train_engine.lora_dropout=0")
    if micro_batch_tokens and pipeline_parallel_size > 1:
        # Pipeline stages exchange one activation shape per schedule; budgeted micro-batches differ in rows.
        raise ValueError(
            "train_engine.micro_batch_tokens > 0 needs pipeline_parallel_size=1 on train_engine=megatron: set "
            "train_engine.micro_batch_tokens=0 (micro_batch_size rows per micro-batch)"
        )
    if torch_dtype(dtype) == torch.float16:
        # megatron-core's fp16 needs its loss scaling driven by a training loop (grad_scale_func, skipped overflow
        # steps while the scale settles): unscaled, the gradients were 2^32 times too small.
        raise ValueError(
            "train_engine=megatron with model.dtype=float16 is not supported: use model.dtype=bfloat16 "
            "(or train_engine=hf / fsdp2 for float16)"
        )
    if trainable and role != "reference" and param_dtype != "float32":
        raise ValueError("train_engine=megatron keeps fp32 master weights (param_dtype=float32)")
