"""Megatron's DistributedDataParallel and optimizer for the `megatron` engine, with the collectives' overlap options.

Contract: `build_optimizer` wraps the engine's GPTModel in megatron.core's DistributedDataParallel (gradients
reduced in fp32; the distributed optimizer optional) and returns it with megatron.core's Adam over fp32 master
weights (bf16/fp16 compute when the engine computes in them). It also sets the model config's hooks the pipeline
schedules call: `finalize_model_grads`, `no_sync`, and with `overlap_grad_reduce` the per-stage `grad_sync_func`.
`optimizer_step` steps at a learning rate and reports whether it stepped; `finish_param_gather` completes the
all-gathers that `overlap_param_gather` leaves to the next forward (before the weights are read or overwritten).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def build_optimizer(
    model: torch.nn.Module,
    config: Any,
    lr: float,
    weight_decay: float,
    betas: Any,
    clip: float,
    distributed: bool,
    compute_dtype: torch.dtype,
    overlap: tuple[bool, bool],
    decay_norms_and_biases: bool = False,
) -> tuple[Any, Any]:
    """(DistributedDataParallel, MegatronOptimizer) for `model`; `overlap` is (overlap_grad_reduce,
    overlap_param_gather), `clip` the max gradient norm (<= 0: none), `config` the model's TransformerConfig.
    Biases and 1-D parameters (norms) take no weight decay unless `decay_norms_and_biases` (`apply_weight_decay`)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    overlap_grad, overlap_param = overlap
    # Overlap (megatron.core's async collectives; no CUDA stream with one optimizer instance, so gloo runs them
    # too): each gradient bucket's reduction starts in the backward as soon as the bucket's last gradient is
    # accumulated (the last micro-batch's backward), and each bucket's parameter all-gather after a
    # distributed-optimizer step waits for the next forward to reach it (the engine's _gather_params when the
    # weights are read otherwise).
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad,
        overlap_param_gather=overlap_param,
        use_distributed_optimizer=distributed,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    if overlap_grad:  # the pipeline schedules start a stage's reductions after its last backward
        config.grad_sync_func = grad_sync_func(ddp)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        adam_beta1=float(betas[0]),
        adam_beta2=float(betas[1]),
        adam_eps=1e-8,
        clip_grad=clip if clip > 0 else 0.0,
        bf16=compute_dtype == torch.bfloat16,
        fp16=compute_dtype == torch.float16,
        params_dtype=torch.float32,
        use_distributed_optimizer=distributed,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    apply_weight_decay(optimizer, weight_decay, decay_norms_and_biases)
    return ddp, optimizer


def apply_weight_decay(optimizer: Any, weight_decay: float, decay_norms_and_biases: bool = False) -> None:
    """Set each param group's weight decay to `weight_decay` x its `wd_mult`: megatron-core groups biases and 1-D
    parameters (norm weights) with wd_mult 0 (the hf/fsdp2 engines' rule, roll_engines.train._optim.no_decay), but
    only its OptimizerParamScheduler applies the multiplier, and this engine schedules the LR itself: every group
    decayed at the full rate. `decay_norms_and_biases=True` decays every group at `weight_decay`."""
    for group in optimizer.param_groups:
        group["weight_decay"] = weight_decay * (1.0 if decay_norms_and_biases else float(group.get("wd_mult", 1.0)))


def grads_finite(ddp: Any) -> bool:
    """Whether every reduced gradient of every rank is finite (collective over the default process group: all the
    engine's ranks, whatever parameters each holds). megatron-core checks for inf/NaN only under fp16's grad
    scaler: in fp32 and bf16 it clipped nothing (a NaN norm is never above the limit) and stepped, making every
    weight and Adam moment NaN while the step was reported skipped."""
    import torch.distributed as dist

    ok = all(bool(torch.isfinite(b.grad_data).all()) for b in [*ddp.buffers, *ddp.expert_parallel_buffers])
    flag = torch.tensor([0.0 if ok else 1.0])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag) == 0.0


def optimizer_step(optimizer: Any, lr: float, ddp: Any = None) -> tuple[float, bool]:
    """Set every parameter group's learning rate to `lr` and step; returns (grad norm, stepped). A step whose
    gradients are not finite (on any rank: `grads_finite(ddp)`) is skipped, weights and moments untouched (the
    caller's LR schedule then does not advance either)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    if ddp is not None and not grads_finite(ddp):
        return float("nan"), False
    ok, norm, _ = optimizer.step()
    norm = float(norm) if norm is not None else float("nan")
    return norm, bool(ok) and math.isfinite(norm)


def finish_param_gather(ddp: Any) -> None:
    """Finish the parameter all-gathers that overlap_param_gather left to the next forward (collective)."""
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        # Not dispatched: gather now; dispatched by a forward and still in flight: wait for it.
        if not group.param_gather_dispatched or group.param_gather_handle is not None:
            group.start_param_sync(force_sync=True)


def grad_sync_func(ddp: Any) -> Callable[..., None]:
    """The pipeline schedules' `grad_sync_func`: start every bucket group's reduction with the DDP's
    `force_all_reduce` (the engine's `compute_gradients` sets it: whole gradients on every rank).

    megatron-core's own `DistributedDataParallel.start_grad_sync` drops that flag (0.16): on a pipeline stage other
    than the first, whose reductions the schedule starts through this function rather than the backward hooks,
    `compute_gradients` under the distributed optimizer would get reduce-scattered gradients (each rank's shard
    right, the rest partial sums) while the first stage all-reduced."""

    def start(*unused: Any) -> None:
        for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            group.start_grad_sync(force_all_reduce=ddp.force_all_reduce)

    return start
