"""Shared code for platforms that torch drives through `torch.cuda`: NVIDIA CUDA and AMD ROCm/HIP builds."""

from __future__ import annotations

from typing import ClassVar

from roll_hw._torch_device import TorchAcceleratorPlatform, torch_importable


class TorchCudaLikePlatform(TorchAcceleratorPlatform):
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
        return torch_importable() and cls._torch_build_matches() and cls.device_count() > 0

    @classmethod
    def unavailable_reason(cls) -> str:
        if not torch_importable():  # the pip extra too: what to install is the point of this message
            return f"torch is not installed; install {cls.install_hint}"
        import torch

        if not cls._torch_build_matches():
            return f"this torch ({torch.__version__}) is not a {cls._build.upper()} build; install {cls.install_hint}"
        return cls.no_device_reason()

    @classmethod
    def supports_bf16(cls) -> bool:
        """Native bf16 on the current device. Not `torch.cuda.is_bf16_supported()` with its default: that is also
        true where bf16 is only emulated (V100, T4), which runs slower than fp32 and which vLLM refuses, so
        `dtype=auto` would pick a dtype the engines cannot use. CUDA and ROCm refine this rule."""
        import torch

        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
