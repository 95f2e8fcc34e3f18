"""AMD GPUs through ROCm builds of torch (the `torch.cuda` API over HIP); collectives over RCCL via "nccl"."""

from __future__ import annotations

from typing import ClassVar

from roll_hw._torch_gpu import TorchCudaLikePlatform


class RocmPlatform(TorchCudaLikePlatform):
    """AMD ROCm. torch calls the device "cuda" and the RCCL backend "nccl"; detection uses `torch.version.hip`."""

    name: ClassVar[str] = "rocm"
    visible_devices_env: ClassVar[str | None] = "HIP_VISIBLE_DEVICES"
    ray_noset_env: ClassVar[str | None] = "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"  # Ray 2.60's name
    description: ClassVar[str] = "AMD GPU (ROCm/HIP)"
    install_hint: ClassVar[str] = "roll-hw[rocm] (a ROCm build of torch)"
    _build: ClassVar[str] = "hip"

    @classmethod
    def visibility_vars(cls) -> tuple[str, ...]:
        """ROCm's torch counts devices through HIP_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES."""
        return ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")

    @classmethod
    def supports_bf16(cls) -> bool:
        """True on GPUs with bf16 matrix instructions: MI100 (gfx908), MI200 (gfx90a), MI300 (gfx94x), MI350
        (gfx950) and RDNA3+ (gfx11xx, gfx12xx); false on MI50/MI60 (gfx906), Vega and RDNA1/2. On ROCm
        `torch.cuda.is_bf16_supported()` is true for every device and the compute capability does not tell these
        apart (gfx906 and gfx90a both report 9.0), so the architecture name decides."""
        import torch

        arch = str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "gcnArchName", ""))
        return rocm_arch_has_bf16(arch)


def rocm_arch_has_bf16(arch: str) -> bool:
    """Whether an AMD GPU architecture (`gcnArchName`, e.g. "gfx90a:sramecc+:xnack-") runs bf16 natively."""
    name = arch.split(":", 1)[0].lower().removeprefix("gfx")
    if not name:
        return False  # unknown device: fp32 is the safe choice (`dtype=auto`)
    if len(name) == 4:  # gfx1030, gfx1100, gfx1201: RDNA; WMMA bf16 from RDNA3 (gfx11xx) on
        return name[:2] >= "11"
    # gfx9xx: CDNA has bf16 matrix cores (gfx908, gfx90a, gfx94x, gfx95x); Vega (gfx900, gfx906, the gfx90c APU)
    # does not.
    return name in ("908", "90a") or name[:2] in ("94", "95")
