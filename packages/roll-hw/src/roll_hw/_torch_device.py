"""Shared code for platforms whose devices torch drives through a `torch.<device>` module (`torch.cuda` for
NVIDIA CUDA and AMD ROCm, `torch.npu` for Ascend once torch_npu is imported).

Probes call `device_count()`, which asks the driver/NVML for a count without creating a device context.
Subclasses say which module (`_device_module`) and implement `is_available`/`unavailable_reason`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from roll_hw.interface import MemoryStats, Platform


def torch_importable() -> bool:
    """True when torch is installed (found without importing it)."""
    return importlib.util.find_spec("torch") is not None


class TorchAcceleratorPlatform(Platform):
    """Device methods over `torch.<device_type>` (cuda, npu): count, set, synchronize, memory, seeding."""

    @classmethod
    def visibility_vars(cls) -> tuple[str, ...]:
        """Every environment variable that hides devices from this process (ROCm's torch honours three)."""
        return (cls.visible_devices_env,) if cls.visible_devices_env else ()

    @classmethod
    def no_device_reason(cls) -> str:
        """Why no device is visible, naming the visibility variables as they are set: a device hidden by
        `CUDA_VISIBLE_DEVICES=''` (what older Ray, or Ray 2.60 with RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1, gives a
        worker that reserved no GPU), `-1` or a stale UUID is not a driver problem, and on ROCm
        `ROCR_VISIBLE_DEVICES` or `CUDA_VISIBLE_DEVICES` may be the one that hides it."""
        names = cls.visibility_vars()
        shown = [f"{name}={os.environ[name]!r}" for name in names if name in os.environ]
        if not shown:
            return f"no device visible ({' / '.join(names) or 'no visibility variable'} not set: check the driver)"
        hint = ""
        if any(os.environ[name] == "" for name in names if name in os.environ) and cls.ray_resource:
            hint = f"; '' hides every device: Ray sets it in a worker that reserved no {cls.ray_resource}"
        return f"no device visible with {', '.join(shown)} (check it names devices this node has{hint})"

    @classmethod
    def _device_module(cls) -> Any:
        """The torch submodule of this device kind (imports torch, and the vendor extension if any)."""
        import torch

        return getattr(torch, cls.device_type)

    @classmethod
    def device_count(cls) -> int:
        return int(cls._device_module().device_count())

    @classmethod
    def set_device(cls, index: int) -> None:
        cls._device_module().set_device(index)

    @classmethod
    def synchronize(cls) -> None:
        cls._device_module().synchronize()

    @classmethod
    def empty_cache(cls) -> None:
        cls._device_module().empty_cache()

    @classmethod
    def memory_stats(cls, index: int = 0) -> MemoryStats:
        mod = cls._device_module()
        free, total = mod.mem_get_info(index)
        return MemoryStats(
            total=total, free=free, allocated=mod.memory_allocated(index), reserved=mod.memory_reserved(index)
        )

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        return str(cls._device_module().get_device_name(index))

    @classmethod
    def supports_fp16(cls) -> bool:
        return True

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        """Seed the host, and this platform's devices where this process has them: a CPU-only head of a Ray
        cluster that names the workers' platform (hw.platform=npu) seeds its host only (it crashed without
        torch_npu there; the workers seed their own devices)."""
        super().seed_everything(seed)
        try:
            mod = cls._device_module()
        except (ImportError, AttributeError):  # the platform's torch extension is not on this host
            return
        mod.manual_seed_all(seed)  # lazy in torch: nothing is initialised on a host without devices
