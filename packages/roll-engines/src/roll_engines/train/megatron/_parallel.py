"""The torch.distributed process group and Megatron's parallel state of a `megatron` engine's process.

A worker group's process (RANK in the environment) joins the group its rendezvous describes, and that group lives
as long as the process. An engine on its own (cluster=local, tests) starts a group of one on loopback and ends it
at shutdown, so that a later engine in the same process starts afresh.
"""

from __future__ import annotations

import os

import torch


def init_parallel(
    device: torch.device, tp: int, pp: int, backend: str | None, seed: int, ep: int = 1, cp: int = 1
) -> bool:
    """Join or start the process group, build Megatron's TP x CP x PP (x EP) groups over it and seed its RNG
    tracker; returns whether this call started a group of one (then the caller ends it with `end_parallel`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    started = False
    if not dist.is_initialized():
        if ps.model_parallel_is_initialized():  # groups of a process group destroyed since
            ps.destroy_model_parallel()
        if backend is None:
            from roll_engines.train._settings import backend_for

            backend = backend_for(device)
        if "RANK" in os.environ:  # a worker group's process: the rendezvous is in the environment
            dist.init_process_group(backend=backend)
        else:  # one process on its own: a group of one, without touching the environment
            from roll_core.cluster.ports import free_port

            url = f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(backend=backend, init_method=url, rank=0, world_size=1)
            started = True
    world = dist.get_world_size()
    if world % (tp * pp * cp) or (world // (tp * pp * cp)) % ep:
        raise ValueError(
            f"{world} ranks cannot form tensor_parallel_size={tp} x pipeline_parallel_size={pp} x "
            f"context_parallel_size={cp} with expert_model_parallel_size={ep} dividing the data-parallel size"
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
        )
    if device.type == "cpu":
        from roll_engines.train.megatron._cpu import seed_cpu_tracker

        seed_cpu_tracker(seed)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return started


def end_parallel() -> None:
    """Destroy Megatron's parallel state and the process group (a group of one that `init_parallel` started)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
