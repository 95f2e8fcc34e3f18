"""NVIDIA GPUs through CUDA builds of torch; collectives over NCCL."""

from __future__ import annotations

from typing import ClassVar

from roll_hw._torch_gpu import TorchCudaLikePlatform


class CudaPlatform(TorchCudaLikePlatform):
    """NVIDIA CUDA. Detected when torch is a CUDA build (no `torch.version.hip`) and sees a device."""

    name: ClassVar[str] = "cuda"
    visible_devices_env: ClassVar[str | None] = "CUDA_VISIBLE_DEVICES"
    ray_noset_env: ClassVar[str | None] = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"  # Ray 2.60's name
    description: ClassVar[str] = "NVIDIA GPU (CUDA)"
    install_hint: ClassVar[str] = "roll-hw[cuda] (a CUDA build of torch)"
    _build: ClassVar[str] = "cuda"
    #: Compute capability from which bf16 runs natively (Ampere, sm_80); vLLM requires the same for bfloat16.
    bf16_min_capability: ClassVar[tuple[int, int]] = (8, 0)

    @classmethod
    def supports_bf16(cls) -> bool:
        """True from compute capability 8.0 (A100, A10, RTX 30xx, H100, ...); false on V100 (7.0) and T4 (7.5),
        where `torch.cuda.is_bf16_supported()` is true because bf16 is emulated there."""
        import torch

        return tuple(torch.cuda.get_device_capability()) >= cls.bf16_min_capability
