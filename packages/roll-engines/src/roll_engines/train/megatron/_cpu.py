"""Megatron-Core on the CPU platform: the small shims its forward, backward and optimizer need (measured with
megatron-core 0.16.1 on torch 2.13 CPU over gloo; /work notes in bench/RESULTS.md).

Applied explicitly, only while a Megatron engine call runs on CPU (`cpu_shims()` context, entered by `engine_shims`
for every engine call), never at import:
1. `torch.cuda.current_device` returns "cpu": megatron passes it as the device of buffers it creates during
   forward/backward (RoPE tables, the global memory buffer, tensor-parallel gathers, pipeline receives).
2. `torch.cuda.synchronize` does nothing (pipeline send/receive calls it).
3. megatron's CUDA RNG tracker is replaced by one over CPU generators, seeded with megatron's own offsets
   (attention dropout forks the tracker on every forward, even at dropout 0).
4. Activation recomputation saves and restores "CUDA" RNG states around recomputed blocks: on the CPU they are
   the default generator's (torch.get_rng_state / set_rng_state).
5. A TorchFunctionMode rewrites literal `device="cuda"` / `.cuda()` to the CPU (training schedules, optimizer,
   gradient clipping create tensors on "cuda" by name) and reports CPU tensors' `.type()` under the CUDA name
   that megatron's optimizer asserts. Cost: about 1 µs per torch call while active.
6. `torch.cuda.Stream`, `current_stream` and `stream` are streams that order nothing (the MoE all-to-all token
   dispatcher copies its split sizes to the host on a side stream and waits for an event of it): CPU work is
   already in program order.
7. The dispatcher's "device to host" copy of its all-to-all split sizes makes NumPy arrays of CUDA tensors only;
   CPU tensors stay tensors, which `all_to_all_single` does not take as split sizes: they become arrays too.
8. `pin_memory=True` is dropped (the mode of 5): pinning stages host-to-CUDA copies, which here are no copies, and
   a torch without an accelerator refuses it (YaRN's rotary table under context parallelism, built with the model,
   indexes its CP slice with a pinned tensor).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class CPURNGStatesTracker:
    """megatron's CudaRNGStatesTracker interface over CPU generator states."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"rng state {name!r} (seed {seed}) already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name!r} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


class _HostStream:
    """A CUDA stream stand-in: CPU work runs in program order, so waiting, events and syncs are no-ops."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostStream:
        return self  # the "event" only needs .synchronize()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's maybe_move_tensor_to_cpu for tensors already on the host (shim 7)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().numpy()
    return tensor


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Literal CUDA placements in megatron's code go to the CPU instead."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return "torch.cuda." + name[len("torch.") :] if name.startswith("torch.") and ".cuda." not in name else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # shim 8
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """The shims above for the duration of the block; everything is restored afterwards."""
    from megatron.core.tensor_parallel import random as mrandom

    saved = (torch.cuda.current_device, torch.cuda.synchronize)
    saved_streams = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream)
    from megatron.core.transformer.moe import token_dispatcher

    saved_to_host = token_dispatcher.maybe_move_tensor_to_cpu
    saved_tracker = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    saved_rng = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.Stream = lambda *args, **kwargs: _HOST_STREAM  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CPURNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = _TRACKER
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mode = CudaToCpuMode()
    mode.__enter__()
    try:
        yield
    finally:
        mode.__exit__(None, None, None)
        torch.cuda.current_device, torch.cuda.synchronize = saved
        torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream = saved_streams  # type: ignore[misc]
        token_dispatcher.maybe_move_tensor_to_cpu = saved_to_host
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved_rng
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker


#: One tracker per process, kept across calls (its generator states advance like megatron's CUDA ones).
_TRACKER = CPURNGStatesTracker()


def seed_cpu_tracker(seed: int) -> None:
    """CPU replacement of megatron's model_parallel_cuda_manual_seed (same seed offsets per parallel rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    _TRACKER.reset()
    torch.manual_seed(seed)
    _TRACKER.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    _TRACKER.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    _TRACKER.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank(),
    )


@contextlib.contextmanager
def engine_shims(device: torch.device) -> Iterator[None]:
    """What every Megatron engine call runs under: `cpu_shims()` on CPU; everywhere, torch's deprecation warnings about
    Megatron's own collective calls (e.g. the distributed optimizer's reduce_scatter_tensor, every step) and about the
    TorchScript modules that importing megatron.core loads (torch.fx -> torch.utils.mkldnn) are silenced: the user
    cannot act on them."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
        warnings.filterwarnings("ignore", r"`torch\.jit\.script_method` is deprecated", DeprecationWarning)
        if device.type == "cpu":
            with cpu_shims():
                yield
        else:
            yield
