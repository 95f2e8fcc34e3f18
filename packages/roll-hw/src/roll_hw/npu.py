"""Huawei Ascend NPUs through `torch_npu`; collectives over HCCL.

`torch_npu` is imported only inside methods, and only after the probe found it, so a missing or broken
torch_npu never breaks `import torch` or `import roll_hw` on other machines.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

from roll_hw.interface import MemoryStats, Platform


class NpuPlatform(Platform):
    """Ascend NPU. Devices are a Ray custom resource "NPU"; torch sees them as device type "npu"."""

    name: ClassVar[str] = "npu"
    device_type: ClassVar[str] = "npu"
    ray_resource: ClassVar[str | None] = "NPU"
    visible_devices_env: ClassVar[str | None] = "ASCEND_RT_VISIBLE_DEVICES"
    dist_backend: ClassVar[str] = "hccl"
    description: ClassVar[str] = "Huawei Ascend NPU (torch_npu)"
    install_hint: ClassVar[str] = "roll-hw[npu] (torch_npu matching your CANN toolkit)"
    _import_error: ClassVar[str | None] = None

    @classmethod
    def _torch_npu(cls) -> Any | None:
        """Import torch_npu once; remember why it failed instead of raising."""
        if importlib.util.find_spec("torch_npu") is None:
            cls._import_error = "torch_npu is not installed"
            return None
        try:
            import torch_npu

            return torch_npu
        except Exception as exc:  # a broken CANN install raises all sorts of errors
            cls._import_error = f"torch_npu failed to import: {type(exc).__name__}: {exc}"
            return None

    @classmethod
    def is_available(cls) -> bool:
        if cls._torch_npu() is None:
            return False
        import torch

        return torch.npu.device_count() > 0

    @classmethod
    def unavailable_reason(cls) -> str:
        if cls._torch_npu() is None:
            return f"{cls._import_error}; install {cls.install_hint}"
        return "torch_npu imports but sees no NPU (check the driver and ASCEND_RT_VISIBLE_DEVICES)"

    @classmethod
    def device_count(cls) -> int:
        cls._torch_npu()
        import torch

        return torch.npu.device_count()

    @classmethod
    def set_device(cls, index: int) -> None:
        import torch

        torch.npu.set_device(index)

    @classmethod
    def synchronize(cls) -> None:
        import torch

        torch.npu.synchronize()

    @classmethod
    def empty_cache(cls) -> None:
        import torch

        torch.npu.empty_cache()

    @classmethod
    def memory_stats(cls, index: int = 0) -> MemoryStats:
        import torch

        free, total = torch.npu.mem_get_info(index)
        return MemoryStats(
            total=total,
            free=free,
            allocated=torch.npu.memory_allocated(index),
            reserved=torch.npu.memory_reserved(index),
        )

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        import torch

        return torch.npu.get_device_name(index)

    @classmethod
    def supports_bf16(cls) -> bool:
        return True

    @classmethod
    def supports_fp16(cls) -> bool:
        return True

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        super().seed_everything(seed)
        import torch

        torch.npu.manual_seed_all(seed)
