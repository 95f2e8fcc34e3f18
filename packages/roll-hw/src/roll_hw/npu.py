"""Huawei Ascend NPUs through `torch_npu`; collectives over HCCL.

`torch_npu` is imported only inside methods, and only after the probe found it, so a missing or broken
torch_npu never breaks `import torch` or `import roll_hw` on other machines.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

from roll_hw._torch_device import TorchAcceleratorPlatform


class NpuPlatform(TorchAcceleratorPlatform):
    """Ascend NPU. Devices are a Ray custom resource "NPU"; torch sees them as device type "npu"."""

    name: ClassVar[str] = "npu"
    device_type: ClassVar[str] = "npu"
    ray_resource: ClassVar[str | None] = "NPU"
    visible_devices_env: ClassVar[str | None] = "ASCEND_RT_VISIBLE_DEVICES"
    ray_noset_env: ClassVar[str | None] = "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"  # Ray 2.60's name
    dist_backend: ClassVar[str] = "hccl"
    description: ClassVar[str] = "Huawei Ascend NPU (torch_npu)"
    install_hint: ClassVar[str] = "roll-hw[npu] (torch_npu matching your CANN toolkit)"
    _import_error: ClassVar[str | None] = None
    #: Whether importing torch_npu already failed in this process (it is then not tried again).
    _import_failed: ClassVar[bool] = False

    @classmethod
    def _torch_npu(cls) -> Any | None:
        """torch_npu, imported on first use; None (and `_import_error` says why) where it is missing or broken.

        A failed import is not retried (each probe, `unavailable_reason`, `supports_bf16` and the doctor asked
        again): a retry costs seconds of CANN library loading, and one after a partial import (torch's privateuse1
        backend already renamed "npu") fails with another error that replaced the one that says what is broken.
        """
        if cls._import_failed:
            return None
        if importlib.util.find_spec("torch_npu") is None:
            cls._import_error = "torch_npu is not installed"
            return None
        try:
            import torch_npu

            return torch_npu
        except Exception as exc:  # a broken CANN install raises all sorts of errors
            # One line, as every platform's reason is (the doctor's table, a PlatformUnavailableError): CANN's
            # errors can carry a multi-line library-loading log; its first line says what is missing.
            lines = str(exc).strip().splitlines()
            first = lines[0].rstrip() if lines else ""
            if len(lines) > 1:
                first += " ..."
            cls._import_error = f"torch_npu failed to import: {type(exc).__name__}: {first}"
            cls._import_failed = True
            return None

    @classmethod
    def is_available(cls) -> bool:
        return cls._torch_npu() is not None and cls.device_count() > 0

    @classmethod
    def unavailable_reason(cls) -> str:
        if cls._torch_npu() is None:
            return f"{cls._import_error}; install {cls.install_hint}"
        return f"torch_npu imports but sees no NPU: {cls.no_device_reason()}"

    @classmethod
    def _device_module(cls) -> Any:
        cls._torch_npu()  # registers torch.npu
        return super()._device_module()

    @classmethod
    def supports_bf16(cls) -> bool:
        """torch_npu's own answer (Ascend 910B and later; 910A, 910Pro and 310P have no bf16)."""
        if cls._torch_npu() is None:
            return False
        import torch

        check = getattr(getattr(torch, "npu", None), "is_bf16_supported", None)
        return bool(check()) if callable(check) else True
