"""The `Platform` interface: what roll needs to know about one kind of accelerator.

Contract:
- A platform is a class, never instantiated; everything is a class attribute or a classmethod.
- `is_available()` is a cheap probe: it may import torch (or a vendor extension) but must not create a device
  context, allocate device memory or spawn processes, so `roll-doctor` and config validation stay fast.
- Nothing here is engine-specific. Engines keep their own per-device tables keyed by `device_type`; anything a
  backend would need to monkey-patch is a missing method on this class, to be added here.
- This module imports no torch at module level: roll-hw must import on a machine without torch.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one device, in bytes. `allocated`/`reserved` are this process's; `total`/`free` the device's."""

    total: int
    free: int
    allocated: int
    reserved: int


class PlatformUnavailableError(RuntimeError):
    """A platform was requested (by `ROLL_PLATFORM` or config) but cannot be used on this machine."""


class Platform:
    """Describes one hardware backend. Subclass it and register the subclass under `roll.platforms`."""

    #: Short unique name used by `ROLL_PLATFORM`, `hw=` configs and the registry ("cpu", "cuda", ...): the name its
    #: `roll.platforms` entry point declares (roll_hw.detect refuses another; workers resolve the platform by it).
    name: ClassVar[str] = "base"
    #: torch device type ("cpu", "cuda", "npu"); ROCm reuses "cuda" because torch does.
    device_type: ClassVar[str] = "cpu"
    #: Ray resource key a worker asks for per device ("GPU", "NPU"), or None when devices are not Ray resources.
    ray_resource: ClassVar[str | None] = None
    #: Environment variable that restricts which devices a process sees, or None.
    visible_devices_env: ClassVar[str | None] = None
    #: Ray's switch that, set to 1, stops Ray from setting `visible_devices_env` in its workers (each then sees every
    #: device of its node: roll_hw.ray_devices), or None where Ray has none (roll narrows such devices itself).
    ray_noset_env: ClassVar[str | None] = None
    #: torch.distributed backend for collectives between devices of this kind.
    dist_backend: ClassVar[str] = "gloo"
    #: Human-readable vendor/description for `roll-doctor`.
    description: ClassVar[str] = ""
    #: The pip extra that installs what this platform needs (shown in errors).
    install_hint: ClassVar[str] = ""

    # ---- probes -------------------------------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> bool:
        """Cheap probe: True when this platform can be used in this process."""
        raise NotImplementedError

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why `is_available()` is False, phrased so that a user knows what to install or set."""
        return f"platform {cls.name!r} is not available on this machine"

    @classmethod
    def device_count(cls) -> int:
        """Number of devices this process can see (1 for CPU)."""
        raise NotImplementedError

    # ---- devices ------------------------------------------------------------------------------------------
    @classmethod
    def torch_device(cls, index: int | None = None) -> str:
        """torch device string, e.g. "cuda:0"; `index=None` gives the bare type."""
        return cls.device_type if index is None else f"{cls.device_type}:{index}"

    @classmethod
    def set_device(cls, index: int) -> None:
        """Make `index` the current device of this process."""

    @classmethod
    def synchronize(cls) -> None:
        """Wait for queued device work to finish (for timing)."""

    @classmethod
    def empty_cache(cls) -> None:
        """Release cached, unused device memory back to the device."""

    @classmethod
    def memory_stats(cls, index: int = 0) -> MemoryStats:
        """Memory of device `index`."""
        raise NotImplementedError

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        """Marketing name of device `index` (for logs and `roll-doctor`)."""
        return cls.name

    # ---- numerics -----------------------------------------------------------------------------------------
    @classmethod
    def supports_bf16(cls) -> bool:
        """True when bf16 matmuls are fast enough to train in (not merely supported)."""
        return False

    @classmethod
    def runs_bf16(cls) -> bool:
        """True when an explicit bf16 request runs natively (it may still be slower to train in than fp32):
        such a request is honoured; `dtype=auto` follows `supports_bf16`."""
        return cls.supports_bf16()

    @classmethod
    def bf16_note(cls) -> str:
        """One line on this platform's bf16 (for `roll-doctor` and benchmark headers)."""
        return "native" if cls.supports_bf16() else "not fast: bf16 becomes fp32"

    @classmethod
    def supports_fp16(cls) -> bool:
        """True when fp16 matmuls are fast enough to train in."""
        return False

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        """Seed Python, NumPy and torch (host and this platform's devices)."""
        random.seed(seed)
        os.environ["PYTHONHASHSEED"] = str(seed)
        try:
            import numpy as np

            np.random.seed(seed % (2**32))
        except ImportError:  # numpy is optional for roll-hw
            pass
        try:
            import torch

            torch.manual_seed(seed)
        except ImportError:
            pass

    # ---- config hook --------------------------------------------------------------------------------------
    @classmethod
    def check_and_update_config(cls, cfg: Any) -> list[str]:
        """Adjust a run config for this platform in place; return one line per change made.

        `cfg` is any object with optional attributes `dtype` (str) and `dist_backend` (str). The base rule:
        a reduced-precision dtype the platform cannot run fast becomes float32, and the distributed backend
        defaults to this platform's. Subclasses extend it and call `super()`.
        """
        changes: list[str] = []
        dtype = getattr(cfg, "dtype", None)
        if dtype in ("bfloat16", "bf16") and not cls.runs_bf16():
            cfg.dtype = "float32"
            changes.append(f"dtype bfloat16 -> float32: {cls.name} has no fast bf16")
        elif dtype in ("float16", "fp16") and not cls.supports_fp16():
            cfg.dtype = "float32"
            changes.append(f"dtype float16 -> float32: {cls.name} has no fast fp16")
        elif dtype == "auto":
            cfg.dtype = "bfloat16" if cls.supports_bf16() else "float32"
            changes.append(f"dtype auto -> {cfg.dtype}")
        if hasattr(cfg, "dist_backend") and cfg.dist_backend in (None, "", "auto"):
            cfg.dist_backend = cls.dist_backend
            changes.append(f"dist_backend -> {cls.dist_backend}")
        return changes

    @classmethod
    def ray_resources(cls, num_devices: int) -> dict[str, float]:
        """Ray custom-resource request for `num_devices` devices (empty on CPU)."""
        if cls.ray_resource is None or num_devices == 0:
            return {}
        return {cls.ray_resource: float(num_devices)}

    @classmethod
    def visible_devices_for(cls, device_ids: list[int]) -> dict[str, str]:
        """Environment a worker needs to see exactly `device_ids` (empty dict when not applicable)."""
        if cls.visible_devices_env is None:
            return {}
        return {cls.visible_devices_env: ",".join(str(i) for i in device_ids)}

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Key facts for `roll-doctor`, as strings."""
        available = cls.is_available()
        out = {
            "platform": cls.name,
            "available": "yes" if available else f"no ({cls.unavailable_reason()})",
            "torch device": cls.torch_device(),
            "ray resource": cls.ray_resource or "-",
            "visible-devices env": cls.visible_devices_env or "-",
            "dist backend": cls.dist_backend,
        }
        if available:
            out["devices"] = str(cls.device_count())
            out["device name"] = cls.device_name(0)
            out["bf16 / fp16"] = f"{cls.supports_bf16()} / {cls.supports_fp16()}"
            out["bf16"] = cls.bf16_note()
            try:
                mem = cls.memory_stats(0)
                out["memory (free/total)"] = f"{mem.free / 2**30:.1f} / {mem.total / 2**30:.1f} GiB"
            except Exception as exc:  # doctor must never crash on a stats call
                out["memory (free/total)"] = f"unknown ({exc})"
        return out
