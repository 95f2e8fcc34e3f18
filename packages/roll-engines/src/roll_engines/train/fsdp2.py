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

Loading (roll_engines.train._fsdp2_load): only rank 0 reads the checkpoint (`from_pretrained` into host memory, as
the single-process engine); the other ranks build the model on the meta device from its config, so a node of N
ranks holds one host copy, not N. Every rank shards its model with `fully_shard`; the meta ranks then allocate their
shards and rank 0 broadcasts the full tensors one at a time, each rank keeping its shard (torch's
`set_model_state_dict(..., broadcast_from_rank0=True)`); buffers outside the state dict (rotary `inv_freq`) come
from rank 0's model too, and LoRA adapters and a critic's new value head take rank 0's seeded initialisation. No
device ever holds the full model. A checkpoint `load` (resume) also reads `model/` (or a LoRA run's `adapter/`) on
rank 0 alone. Remote-code models (`trust_remote_code`) take the same path: rank 0 imports the checkpoint's code
before the other ranks do (transformers copies it into a shared module cache). A rank that cannot build the model
on meta (its construction fails or differs from rank 0's) reads the checkpoint itself, and a quantized checkpoint
is read by every rank (both logged); a group of one reads it as the hf engine does.

Collectives: `get_weights`, `save` and `load` gather or scatter full tensors and must be called on every rank
(the worker group's broadcast dispatch does that); only rank 0 returns or writes the full model. A failure of what
rank 0 does alone in `save` (writing `model/`, the tokenizer) or `load` (reading `model/`) raises on every rank, not
only on rank 0 while the others wait in the next collective until the process group times out. A tied parameter is
written once (under the name transformers keeps), whatever the number of ranks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from roll_engines.train import _fsdp2_load as L
from roll_engines.train._hf_checkpoint import shared_names
from roll_engines.train._settings import backend_for
from roll_engines.train.hf import HFTrainEngine

log = logging.getLogger(__name__)
T = TypeVar("T")


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

    #: The mixed-precision policy casts every parameter for the forward, the actor's and a reference's alike: a frozen
    #: model is held wholly in the compute dtype (roll_engines.train._precision).
    autocasts: ClassVar[bool] = False

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

    def _instantiate(self, model_class: Any, kwargs: dict[str, Any]) -> torch.nn.Module:
        """Rank 0 reads the checkpoint, the other ranks build the model on the meta device (module docstring);
        `_wrap` fills them from rank 0."""
        import torch.distributed as dist

        self._on_meta = False  # this rank's model has no weights until `_wrap` broadcasts rank 0's
        self._from_rank0 = dist.get_world_size() > 1  # the other ranks' weights come from rank 0 (`_wrap`)
        if not self._from_rank0:
            return super()._instantiate(model_class, kwargs)
        # Every rank reads the config (a few kB; the meta build needs it; L.read_config): with trust_remote_code
        # after rank 0 has imported the checkpoint's code, which transformers copies into a shared cache.
        config = L.read_config(self.path, model_class, kwargs, self.device)
        refusal = L.meta_refusal(config)
        if refusal is not None:
            if dist.get_rank() == 0:
                log.warning("fsdp2: every rank reads %s: %s cannot be built on the meta device", self.path, refusal)
            self._from_rank0 = False
            return super()._instantiate(model_class, kwargs)
        model, self._on_meta = L.instantiate(
            lambda: super(FSDP2TrainEngine, self)._instantiate(model_class, kwargs),
            lambda: L.build_on_meta(model_class, config, kwargs),
            self.device,
            self.path,
        )
        return model

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Leave the loaded model in host memory (rank 0; the others' is on meta): `fully_shard` moves each unit's
        parameters to the device as it shards them (FSDP2's `_move_states_to_device`), so a GPU holds its shards,
        never the whole model (moving it first put the full model on every rank's GPU before sharding)."""
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
        source = None
        if self._from_rank0:
            L.check_same_structure(model, self.device)  # LoRA etc. applied alike on meta and on rank 0's model
            source = L.full_state(model) if self.dp_rank == 0 else None  # full tensors, freed once broadcast
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        if self._from_rank0:
            L.materialize(model, source, self._on_meta, self.device)
            del source
            from roll_hw.cpu import fp32_linear_library

            if self._on_meta and self.device.type == "cpu" and fp32_linear_library() == "onednn":
                # The engine switched the linears before `_wrap`, which skips weights on meta: switch them now,
                # or this rank would compute with another kernel than rank 0 (roll_engines._onednn_linear).
                from roll_engines._onednn_linear import use_onednn_linears

                use_onednn_linears(model)
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
            # A tied parameter's names get one tensor each, gathered apart over several ranks: save_pretrained, which
            # drops a tie's alias only when the tensors share storage, wrote a tied LM head beside the embedding (a
            # vocab x hidden copy that a group of one did not write). One tensor under every name, as one process.
            for names in shared_names(self.model):
                held = [n for n in names if n in full]
                for alias in held[1:]:
                    full[alias] = full[held[0]]
            # save_pretrained on the wrapped model would write DTensors: hand it the gathered state instead.
            self.model.save_pretrained(folder, state_dict=full, safe_serialization=True)

    def _on_every_rank(self, work: Callable[[], T], what: str) -> T:
        """`work()` on this rank, then one all-reduce: a failure on any rank raises on every rank before any goes on
        to its next collective. Rank 0 alone writes `model/` and reads it at a load; its failure (a full disk, a
        truncated file) left the other ranks waiting in the optimizer's save, or in the weights' broadcast, until
        the process group timed out (30 minutes). The failing rank raises its own exception, the others a
        RuntimeError naming `what`, the first failing rank and its error."""
        import torch.distributed as dist

        error: Exception | None = None
        result: Any = None
        try:
            result = work()
        except Exception as e:  # must reach the other ranks before their next collective
            error = e
        size = self.dp_size
        if size <= 1:
            if error is not None:
                raise error
            return result
        first = size - self._all_reduce_max(size - self.dp_rank if error is not None else 0)
        if first == size:
            return result
        box = [f"{type(error).__name__}: {error}" if self.dp_rank == first else None]
        dist.broadcast_object_list(box, src=first, device=self.device)  # device: nccl sends from this rank's GPU
        if error is not None:
            raise error
        raise RuntimeError(f"fsdp2: {what} failed on data-parallel rank {first} of {size}: {box[0]}")

    def _read_model_folder(self, folder: Path) -> dict[str, Tensor]:
        """Rank 0 reads the checkpoint's tensors; the others get them from it (`_load_full_weights`)."""
        return super()._read_model_folder(folder) if self.dp_rank == 0 else {}

    def _load_adapter(self, folder: Path) -> None:
        """Rank 0 reads the checkpoint's `adapter/` and broadcasts it; every rank loads it into its shards (peft's
        renaming runs on every rank alike). The adapter is small next to the model, so each rank holds it whole
        for the moment of loading, as when every rank read the file."""
        from roll_engines.train._lora import read_adapter, set_adapter

        read = lambda: read_adapter(folder, self.model)  # rank 0 also checks the saved rank and alpha
        set_adapter(self.model, L.tensors_from_rank0(read, self.device, str(folder)))

    def _check_full_weights(self, weights: dict[str, Tensor]) -> None:
        """Rank 0's full `weights` checked on rank 0: a mismatch (missing, unexpected, misshapen) raises on every
        rank (collective)."""
        L.check_from_rank0(self.model, weights, self.device)

    def _load_full_weights(self, weights: dict[str, Tensor], checked: bool = False) -> None:
        """Shard rank 0's full `weights`, checked first unless already `checked` (`_check_full_weights`)."""
        L.load_from_rank0(self.model, weights, self.device, check=not checked)
