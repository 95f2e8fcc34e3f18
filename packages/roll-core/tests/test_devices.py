"""roll_core.devices.resolve_device: the platform a role's engine runs on, decided on its worker."""

from __future__ import annotations

import pytest

import roll_hw
from roll_core.devices import resolve_device
from roll_hw.cpu import CpuPlatform
from roll_hw.npu import NpuPlatform


def test_the_engines_current_platform_is_the_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines ask roll_hw.current_platform (their distributed backend, memory); it was a fresh auto-detection, not
    the run's hw.platform, so an active plugin (or a broken one) decided for a run that named cpu."""
    roll_hw.set_current_platform(NpuPlatform)  # what detection would have said (a plugin platform, say)
    try:
        out = resolve_device({"platform": "cpu", "device": "auto", "dtype": "float32", "role": "actor"})
        assert out["device"] == "cpu" and roll_hw.current_platform is CpuPlatform
    finally:
        roll_hw.set_current_platform(None)


def test_a_platform_whose_probe_raises_names_itself_and_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_hw import detect

    class Raising(CpuPlatform):
        @classmethod
        def is_available(cls) -> bool:
            raise OSError("libacme_driver.so: cannot open shared object file")

    real = detect.get_platform_class
    monkeypatch.setattr(detect, "get_platform_class", lambda name: Raising if name == "acme" else real(name))
    with pytest.raises(RuntimeError, match=r"^\S+: platform 'acme' \(requested\).*raised OSError: libacme_driver"):
        resolve_device({"platform": "acme", "device": "auto"})
