"""Which GPU a one-GPU vLLM engine runs on: `device_args` turns roll's resolved device into vLLM's engine argument.

Contract: `device_args(device, ...)` returns the keyword arguments to add to `vllm.LLM(...)` so that vLLM's engine
core (its own process on GPUs) computes on `device`, the torch device of roll's process ("cuda:3"); {} where
vLLM's default, local device 0 of what the process sees, is already it. It imports nothing from vLLM (checked on
any venv); the caller says whether the installed vLLM has the argument (`vllm_has_device_ids`).

Why: vLLM 0.32's single-GPU executor (UniProcExecutor) gives its worker local rank 0 (DeviceConfig no longer takes
"cuda:N": `create_engine_config` rebuilds it from the platform's bare type), and the worker makes `cuda:<local
rank>` current. Where Ray narrowed the worker's visibility that is its GPU; under Ray's
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 every worker of a node sees all its GPUs (roll_hw.ray_devices), and
every vLLM engine of the node silently ran on GPU 0.

The mechanism: vLLM's own `device_ids` engine argument (`--device-ids`, EngineArgs/ParallelConfig
`assigned_physical_gpu_ids`), made to select GPUs without touching CUDA_VISIBLE_DEVICES. An integer id is an index
into CUDA_VISIBLE_DEVICES where it is set (the physical id where unset), which is exactly how torch numbers the
devices of roll's process, so `device_ids=[N]` for roll's `cuda:N`; vLLM's worker maps it back to the visible
ordinal (`Platform.logical_device_id_to_visible_device_id`) and makes `cuda:N` current in the engine core. The
engine core inherits roll's visibility un-narrowed, so both processes number the GPUs alike, and a CUDA IPC handle
(torch rebuilds one on the SENDER's device index) names the same GPU in both: the staging buffer roll shares with
vLLM's workers at every weight sync (roll_engines.infer._bucket_channel, CUDA IPC on every GPU whatever
`sync_transport` is), and the trainer's buffers under `sync_transport=cuda_ipc`, which arrive in roll's process.
Narrowing the engine core's visibility instead would have broken both (device N absent, or another GPU).

Refused (RuntimeError, before vLLM starts, naming the switch, the device and the ways out): a device index > 0
with tensor parallel (vLLM's workers then take devices 0..TP-1 of what they see; roll narrows such a Ray worker to
its own GPUs, so its index is 0), and an installed vLLM without `device_ids` (no supported way to pick the GPU).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def device_args(
    device: str | torch.device,
    *,
    tensor_parallel_size: int,
    vllm_has_device_ids: bool,
    noset_env: str | None = None,
    name: str = "vllm",
) -> dict[str, Any]:
    """vLLM engine arguments that put a roll engine on `device` (roll's torch device: "cpu", "cuda", "cuda:N").

    `noset_env`: the name of Ray's NOSET switch where it is on for this worker (the reason the index is not 0;
    only for messages). Returns {} for CPU and local index 0 (vLLM's default), `{"device_ids": [N]}` for
    `cuda:N`, N > 0 (module docstring). Logs the device vLLM was told to use. RuntimeError where vLLM cannot be
    put there safely: tensor parallel with N > 0, or `vllm_has_device_ids` False with N > 0.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    index = dev.index or 0
    why = f" ({noset_env}=1: Ray left every GPU of the node visible)" if noset_env else ""
    if index == 0:
        log.info("%s: vLLM uses cuda:0 of this process's visible GPUs (its default)%s", name, why)
        return {}
    if tensor_parallel_size > 1:
        raise RuntimeError(
            f"{name}: the engine is on cuda:{index}{why} with tensor_parallel_size={tensor_parallel_size}, but "
            f"vLLM's tensor-parallel workers take devices 0..{tensor_parallel_size - 1} of what they see, other "
            "workers' GPUs: a worker spanning several GPUs must be narrowed to them first (roll does so for its Ray "
            "workers: roll_core.devices.narrow_ray_worker), or set CUDA_VISIBLE_DEVICES to its GPUs"
        )
    if not vllm_has_device_ids:
        raise RuntimeError(
            f"{name}: the engine is on cuda:{index}{why}, and this vLLM has no `device_ids` engine argument, its "
            "supported way to choose a GPU without narrowing CUDA_VISIBLE_DEVICES: its engine core would silently "
            "run on cuda:0, another worker's GPU. Unset "
            f"{noset_env or 'RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES'} for this role (Ray then narrows each "
            "worker to its GPU; sync_transport=cuda_ipc still works, colocated roles share that GPU), or install a "
            "vLLM with `device_ids` (0.32 has it)"
        )
    log.info(
        "%s: vLLM told to use cuda:%d (device_ids=[%d], CUDA_VISIBLE_DEVICES left as is)%s", name, index, index, why
    )
    return {"device_ids": [index]}


def vllm_has_device_ids() -> bool:
    """Whether the installed vLLM's EngineArgs take `device_ids` (imports vLLM's engine arguments)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return any(f.name == "device_ids" for f in dataclasses.fields(EngineArgs))


def noset_env() -> str | None:
    """The name of Ray's NOSET switch of the CUDA/ROCm platform where it is on in this process, else None."""
    from roll_hw.cuda import CudaPlatform
    from roll_hw.ray_devices import ray_noset
    from roll_hw.rocm import RocmPlatform

    for platform in (CudaPlatform, RocmPlatform):
        if ray_noset(platform):
            return platform.ray_noset_env
    return None
