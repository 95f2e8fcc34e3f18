"""The out-of-tree dummy platform (tests/plugins/roll-dummy-platform) is discovered through entry points."""

from __future__ import annotations

import pytest

pytest.importorskip("roll_dummy_platform", reason="install tests/plugins/roll-dummy-platform (nox does)")

from roll_dummy_platform import DummyPlatform
from roll_hw import detect, platform_names, resolve_platform
from roll_hw.testing import PlatformTestSuite


class TestDummyPlatformConformance(PlatformTestSuite):
    platform = DummyPlatform


def test_discovered_through_entry_points() -> None:
    assert detect.plugin_platforms()["dummy"] is DummyPlatform
    assert "dummy" in platform_names()


def test_inactive_plugin_does_not_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLL_DUMMY_PLATFORM", raising=False)
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    assert resolve_platform() is not DummyPlatform


def test_active_plugin_wins_over_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_DUMMY_PLATFORM", "1")
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    assert resolve_platform() is DummyPlatform
    assert DummyPlatform.ray_resources(2) == {"DUMMY": 2.0}


def test_forced_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_PLATFORM", "dummy")
    monkeypatch.delenv("ROLL_DUMMY_PLATFORM", raising=False)
    with pytest.raises(Exception, match="ROLL_DUMMY_PLATFORM=1"):
        resolve_platform()
    monkeypatch.setenv("ROLL_DUMMY_PLATFORM", "1")
    assert resolve_platform() is DummyPlatform


def test_doctor_shows_the_plugin(doctor_output: str) -> None:
    out = doctor_output  # roll-doctor run with ROLL_DUMMY_PLATFORM=1 and no ROLL_PLATFORM (conftest.py)
    assert "detected platform          | dummy" in out or "| dummy" in out.splitlines()[2]
