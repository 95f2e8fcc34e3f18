"""Shared code for platforms that torch drives through `torch.cuda` (NVIDIA CUDA and AMD ROCm/HIP).

Probes call `torch.cuda.device_count()`, which asks NVML/the driver for a count without creating a CUDA context,
so a probe never pins memory on device 0 of a process that will later choose another device.
"""

from __future__ import annotations

import importlib.util
from typing import ClassVar

from roll_hw.interface import MemoryStats, Platform


def torch_importable() -> bool:
    """True when torch is installed (found without importing it)."""
    return importlib.util.find_spec("torch") is not None


class TorchCudaLikePlatform(Platform):
    """Base for platforms reached through the `torch.cuda` API. Subclasses set `_build` to "cuda" or "hip"."""

    device_type: ClassVar[str] = "cuda"
    ray_resource: ClassVar[str | None] = "GPU"
    dist_backend: ClassVar[str] = "nccl"
    _build: ClassVar[str] = "cuda"

    @classmethod
    def _torch_build_matches(cls) -> bool:
        import torch

        hip = getattr(torch.version, "hip", None)
        return bool(hip) if cls._build == "hip" else (not hip and torch.version.cuda is not None)

    @classmethod
    def is_available(cls) -> bool:
        if not torch_importable():
            return False
        import torch

        return cls._torch_build_matches() and torch.cuda.device_count() > 0

    @classmethod
    def unavailable_reason(cls) -> str:
        if not torch_importable():
            return "torch is not installed"
        import torch

        if not cls._torch_build_matches():
            return f"this torch ({torch.__version__}) is not a {cls._build.upper()} build; install {cls.install_hint}"
        return "no device visible (check the driver and " + str(cls.visible_devices_env) + ")"

    @classmethod
    def device_count(cls) -> int:
        import torch

        return torch.cuda.device_count()

    @classmethod
    def set_device(cls, index: int) -> None:
        import torch

        torch.cuda.set_device(index)

    @classmethod
    def synchronize(cls) -> None:
        import torch

        torch.cuda.synchronize()

    @classmethod
    def empty_cache(cls) -> None:
        import torch

        torch.cuda.empty_cache()

    @classmethod
    def memory_stats(cls, index: int = 0) -> MemoryStats:
        import torch

        free, total = torch.cuda.mem_get_info(index)
        return MemoryStats(
            total=total,
            free=free,
            allocated=torch.cuda.memory_allocated(index),
            reserved=torch.cuda.memory_reserved(index),
        )

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        import torch

        return torch.cuda.get_device_name(index)

    @classmethod
    def supports_bf16(cls) -> bool:
        import torch

        return bool(torch.cuda.is_bf16_supported())

    @classmethod
    def supports_fp16(cls) -> bool:
        return True

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        super().seed_everything(seed)
        import torch

        torch.cuda.manual_seed_all(seed)
