"""NVIDIA GPUs through CUDA builds of torch; collectives over NCCL."""

from __future__ import annotations

from typing import ClassVar

from roll_hw._torch_gpu import TorchCudaLikePlatform


class CudaPlatform(TorchCudaLikePlatform):
    """NVIDIA CUDA. Detected when torch is a CUDA build (no `torch.version.hip`) and sees a device."""

    name: ClassVar[str] = "cuda"
    visible_devices_env: ClassVar[str | None] = "CUDA_VISIBLE_DEVICES"
    description: ClassVar[str] = "NVIDIA GPU (CUDA)"
    install_hint: ClassVar[str] = "roll-hw[cuda] (a CUDA build of torch)"
    _build: ClassVar[str] = "cuda"
