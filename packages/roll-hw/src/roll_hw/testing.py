"""Conformance suite every platform's tests subclass (as Hydra ships `LauncherTestSuite`).

Usage in a plugin's tests::

    from roll_hw.testing import PlatformTestSuite
    class TestMyPlatform(PlatformTestSuite):
        platform = MyPlatform

Checks that need the device run only when the platform's probe says it is available, so the same suite runs in
CPU CI for every platform's static contract. Requires pytest (imported here only).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import ClassVar

import pytest

from roll_hw.interface import MemoryStats, Platform


class PlatformTestSuite:
    """Shared tests; subclasses set `platform`."""

    platform: ClassVar[type[Platform]]

    def test_static_attributes(self) -> None:
        p = self.platform
        assert isinstance(p.name, str) and p.name and p.name != "base"
        assert isinstance(p.device_type, str) and p.device_type
        assert p.ray_resource is None or isinstance(p.ray_resource, str)
        assert p.visible_devices_env is None or p.visible_devices_env.isupper()
        assert p.dist_backend in {"gloo", "nccl", "hccl", "mpi", "xccl"} or p.dist_backend.islower()

    def test_probe_is_boolean_and_repeatable(self) -> None:
        first = self.platform.is_available()
        assert isinstance(first, bool)
        assert self.platform.is_available() == first

    def test_unavailable_reason_is_text(self) -> None:
        if not self.platform.is_available():
            assert len(self.platform.unavailable_reason()) > 10

    def test_torch_device_strings(self) -> None:
        p = self.platform
        assert p.torch_device() == p.device_type
        assert p.torch_device(3) == f"{p.device_type}:3"

    def test_ray_resources_and_visible_devices(self) -> None:
        p = self.platform
        res = p.ray_resources(2)
        if p.ray_resource is None:
            assert res == {}
        else:
            assert res == {p.ray_resource: 2.0}
        env = p.visible_devices_for([0, 2])
        assert env == ({} if p.visible_devices_env is None else {p.visible_devices_env: "0,2"})

    def test_config_hook_downgrades_unsupported_dtypes(self) -> None:
        p = self.platform
        if not p.is_available():
            pytest.skip(f"{p.name} unavailable: {p.unavailable_reason()}")
        cfg = SimpleNamespace(dtype="bfloat16", dist_backend="auto")
        changes = p.check_and_update_config(cfg)
        assert cfg.dist_backend == p.dist_backend
        assert cfg.dtype == ("bfloat16" if p.runs_bf16() else "float32")  # an explicit bf16 runs where it is native
        if p.supports_bf16():  # fast enough to train in implies native
            assert p.runs_bf16()
        assert all(isinstance(c, str) for c in changes) and changes
        cfg2 = SimpleNamespace(dtype="float32", dist_backend="gloo")
        assert p.check_and_update_config(cfg2) == [] and cfg2.dtype == "float32"

    def test_device_facts_when_available(self) -> None:
        p = self.platform
        if not p.is_available():
            pytest.skip(f"{p.name} unavailable: {p.unavailable_reason()}")
        assert p.device_count() >= 1
        mem = p.memory_stats(0)
        assert isinstance(mem, MemoryStats)
        assert mem.total > 0 and 0 <= mem.free <= mem.total
        assert isinstance(p.device_name(0), str)
        p.synchronize()
        p.empty_cache()
        facts = p.describe()
        assert facts["platform"] == p.name and facts["available"] == "yes"

    def test_seed_everything_is_reproducible(self) -> None:
        p = self.platform
        if not p.is_available():
            pytest.skip(f"{p.name} unavailable: {p.unavailable_reason()}")
        p.seed_everything(123)
        a = random.random()
        p.seed_everything(123)
        assert random.random() == a
