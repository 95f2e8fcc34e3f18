"""The `fsdp2` training engine: the `hf` engine's model sharded with FSDP2 (`fully_shard`) over N processes.

Each worker process is one data-parallel rank holding 1/N of every parameter, gradient and optimizer state.
The process group comes from the environment the worker group sets (RANK, WORLD_SIZE, MASTER_ADDR/PORT); the
backend is the platform's (gloo on CPU, nccl on CUDA/ROCm, hccl on NPU). Every decoder layer is its own FSDP
unit, then the root. FSDP averages gradients over ranks; the base engine's loss scaling (units of this rank's
micro-batch over the units of the whole mini-batch, times N) makes the result equal to the single-process
gradient of the whole batch.

Vision-language models (roll_engines.train._vision): the language model's decoder layers are the units, the
vision tower shards with the root; every rank reduce-scatters the tower's gradients (zeros when its micro-batch
had no picture), so ranks holding pictures and ranks without stay paired.

Loading: every rank reads the checkpoint into host memory and shards it layer by layer onto its device; the full
model is never on a device (torchtitan goes further with meta-device init and rank-0 broadcast, which would also
spare the host copies: not done here).

Collectives: `get_weights`, `save` and `load` gather or scatter full tensors and must be called on every rank
(the worker group's broadcast dispatch does that); only rank 0 returns or writes the full model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from roll_engines.train._hf_checkpoint import check_loaded
from roll_engines.train._settings import backend_for
from roll_engines.train.hf import HFTrainEngine


def _init_process_group(backend: str | None = None) -> bool:
    """Join the worker group's process group, or start a group of one for a process on its own (cluster=local on
    one device: FSDP2 over a mesh of one, the same code as N ranks); returns whether this call started it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if backend is None:
        from roll_hw import current_platform

        backend = current_platform.dist_backend
    if "RANK" in os.environ:  # a worker group's process: the rendezvous is in the environment
        dist.init_process_group(backend=backend)
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise RuntimeError("WORLD_SIZE is set without RANK: the fsdp2 engine cannot tell which rank it is")
    from roll_core.cluster.ports import free_port

    # The environment stays untouched: a group of one needs no rendezvous variables.
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return True


class FSDP2TrainEngine(HFTrainEngine):
    """FSDP2-sharded variant of `HFTrainEngine` (same constructor plus `reshard_after_forward`)."""

    def __init__(
        self, model_path: str, *, reshard_after_forward: bool = True, dist_backend: str | None = None, **kwargs: Any
    ) -> None:
        self.reshard_after_forward = reshard_after_forward
        self._owns_process_group = _init_process_group(dist_backend or backend_for(kwargs.get("device", "cpu")))
        super().__init__(model_path, **kwargs)

    def shutdown(self) -> None:
        """End the process group of one that this engine started (a local run's teardown; a worker group's process
        group is its process's and ends with it)."""
        if self._owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns_process_group = False

    @classmethod
    def conformance_engine(cls, model_path: str, **kwargs: Any) -> FSDP2TrainEngine:
        """One rank in this process for roll_core.testing.train_engine's suite: a gloo group of one (created here
        unless a group exists; the suite destroys it after the test)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            from roll_core.cluster.ports import free_port

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        return cls(model_path, dist_backend="gloo", **kwargs)

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Leave the loaded model in host memory: `fully_shard` moves each unit's parameters to the device as it
        shards them (FSDP2's `_move_states_to_device`), so a GPU holds its shards plus one unsharded layer at a
        time, never the whole model (moving it first put the full model on every rank's GPU before sharding)."""
        self.loaded_on = {p.device.type for p in model.parameters()}  # tests: where the full model lived
        return model

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        from roll_engines.train._lora import base_model

        inner = base_model(model)  # the transformers model inside a LoRA wrapper
        backbone = getattr(inner, "model", inner)
        backbone = getattr(backbone, "language_model", backbone)  # a vision-language model's decoder
        layers = getattr(backbone, "layers", None)
        if layers is None:
            where = "model.model[.language_model].layers"
            raise TypeError(f"cannot find decoder layers ({where}) in {type(model).__name__}")
        # Sharded parameters (and AdamW state) stay in param_dtype; FSDP casts the gathered parameters to the
        # compute dtype for forward/backward and reduces gradients in fp32.
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        kwargs = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward, "mp_policy": mp}
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        if self.vision is not None:
            # The vision tower lives in the root unit; a rank whose micro-batch has no picture leaves its gradients
            # None, and every rank must reduce-scatter the same tensors (zeros for it) or the collective mismatches.
            model.set_reduce_scatter_unused_params(True)
        self.autocast = False  # the policy does the casting
        return model

    @property
    def dp_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    @property
    def dp_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def _all_reduce_sum(self, t: Tensor) -> Tensor:
        import torch.distributed as dist

        t = t.to(self.device, copy=True)  # nccl/hccl reduce device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()

    def _all_reduce_max(self, n: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    # ---- full-state collectives ---------------------------------------------------------------------------
    def _full_state_dict(self) -> dict[str, Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _full_tensor(self, t: Tensor) -> Tensor:
        """All-gather a sharded parameter (collective: every rank calls in the same order)."""
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def gradients(self) -> dict[str, Tensor]:
        """Full (unsharded) gradients, for tests comparing with the single-process engine; every rank calls."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad
                out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu()
        return out

    def _save_model(self, folder: Path) -> None:
        full = self._full_state_dict()
        if self.dp_rank == 0:
            # save_pretrained on the wrapped model would write DTensors: hand it the gathered state instead.
            self.model.save_pretrained(folder, state_dict=full, safe_serialization=True)

    def _load_full_weights(self, weights: dict[str, Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        result = set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        check_loaded(weights, result.missing_keys, result.unexpected_keys)  # as the hf engine (it loaded silently)
