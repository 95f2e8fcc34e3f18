"""A fake accelerator that behaves like the CPU but has its own name, Ray resource and visible-devices variable.

It is active only when `ROLL_DUMMY_PLATFORM=1`, so installing it in a test venv does not change what every other
test sees; `ROLL_PLATFORM=dummy` also selects it (then its probe must pass, so set both).
"""

from __future__ import annotations

import os
from typing import ClassVar

from roll_hw.cpu import CpuPlatform


class DummyPlatform(CpuPlatform):
    """CPU in disguise: device type "cpu", Ray resource "DUMMY", env var DUMMY_VISIBLE_DEVICES."""

    name: ClassVar[str] = "dummy"
    ray_resource: ClassVar[str | None] = "DUMMY"
    visible_devices_env: ClassVar[str | None] = "DUMMY_VISIBLE_DEVICES"
    description: ClassVar[str] = "test-only dummy accelerator"

    @classmethod
    def is_available(cls) -> bool:
        return os.environ.get("ROLL_DUMMY_PLATFORM") == "1"

    @classmethod
    def unavailable_reason(cls) -> str:
        return "set ROLL_DUMMY_PLATFORM=1 to activate the dummy platform"

    @classmethod
    def device_count(cls) -> int:
        return int(os.environ.get("ROLL_DUMMY_DEVICES", "2"))
