"""AMD GPUs through ROCm builds of torch (the `torch.cuda` API over HIP); collectives over RCCL via "nccl"."""

from __future__ import annotations

from typing import ClassVar

from roll_hw._torch_gpu import TorchCudaLikePlatform


class RocmPlatform(TorchCudaLikePlatform):
    """AMD ROCm. torch calls the device "cuda" and the RCCL backend "nccl"; detection uses `torch.version.hip`."""

    name: ClassVar[str] = "rocm"
    visible_devices_env: ClassVar[str | None] = "HIP_VISIBLE_DEVICES"
    description: ClassVar[str] = "AMD GPU (ROCm/HIP)"
    install_hint: ClassVar[str] = "roll-hw[rocm] (a ROCm build of torch)"
    _build: ClassVar[str] = "hip"
