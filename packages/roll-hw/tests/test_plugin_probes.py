"""Out-of-tree platforms whose probe raises, installed through a real `roll.platforms` entry point (a module written
to a temporary folder): the CPU stays reachable and every message names the plugin."""

from __future__ import annotations

import logging
import re
from importlib.metadata import EntryPoint

import pytest

from roll_hw import PlatformUnavailableError, detect, resolve_platform
from roll_hw.cpu import CpuPlatform
from roll_hw.cuda import CudaPlatform
from roll_hw.detect import PlatformPluginError
from roll_hw.npu import NpuPlatform
from roll_hw.rocm import RocmPlatform

_PLUGIN = '''
from roll_hw.cpu import CpuPlatform


class AcmePlatform(CpuPlatform):
    """A vendor platform whose probe raises where its driver library is missing (a plugin bug, but they exist)."""

    name = "{name}"
    device_type = "cpu"

    @classmethod
    def is_available(cls):
        {probe}
'''
_RAISES = 'raise OSError("libacme_driver.so: cannot open shared object file")'


@pytest.fixture
def install_plugin(platform_plugins):
    """Install a raising platform plugin under `name` (a module on sys.path, an entry point of another dist)."""

    def install(name: str, probe: str = _RAISES) -> None:
        module = f"roll_acme_raising_{name}"
        platform_plugins.install(name, module, _PLUGIN.format(name=name, probe=probe), "AcmePlatform")

    return install


def _no_accelerator() -> None:
    if CudaPlatform.is_available() or RocmPlatform.is_available() or NpuPlatform.is_available():
        pytest.skip("an accelerator is detected before cpu here")


def test_a_plugin_named_cpu_whose_probe_raises_gives_way_to_roll_hws_cpu(
    install_plugin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin registered as `cpu` (it replaces roll-hw's) whose probe raises: auto-detection raised a
    PlatformPluginError and ROLL_PLATFORM=cpu a PlatformUnavailableError advising "set ROLL_PLATFORM=cpu", so no
    setting reached the CPU. Now roll-hw's own CPU platform runs, and the log names the plugin and its error."""
    _no_accelerator()
    install_plugin("cpu")
    with caplog.at_level(logging.WARNING, logger="roll_hw.detect"):
        assert resolve_platform() is CpuPlatform
    assert "platform plugin 'cpu' (roll_acme_raising_cpu.AcmePlatform) raised OSError: libacme_driver.so" in caplog.text
    assert "using roll-hw's own cpu platform" in caplog.text
    caplog.clear()
    monkeypatch.setenv("ROLL_PLATFORM", "cpu")
    with caplog.at_level(logging.WARNING, logger="roll_hw.detect"):
        assert resolve_platform() is CpuPlatform
        assert resolve_platform("cpu") is CpuPlatform
    assert "raised OSError: libacme_driver.so" in caplog.text


def test_a_raising_plugin_leaves_a_named_cpu_working_and_says_so_when_auto_detecting(install_plugin) -> None:
    """A plugin under its own name whose probe raises: a run that names cpu (hw.platform=cpu, ROLL_PLATFORM=cpu,
    roll_core.devices with platform cpu) never probes it; auto-detection stops with the plugin's name, its error and
    the setting that avoids it (by design: a vendor node whose driver broke must not train on the CPU unnoticed)."""
    install_plugin("acme")
    assert resolve_platform("cpu") is CpuPlatform
    with pytest.raises(PlatformPluginError) as err:
        resolve_platform()
    message = str(err.value)
    assert "probe of platform plugin 'acme' (roll_acme_raising_acme.AcmePlatform.is_available)" in message
    assert "raised OSError: libacme_driver.so" in message and "ROLL_PLATFORM=<platform>" in message
    with pytest.raises(PlatformUnavailableError, match=r"'acme' \(requested\): its probe .* raised OSError"):
        resolve_platform("acme")


def test_a_plugin_named_cpu_never_wins_over_an_accelerator(install_plugin, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin that replaces roll-hw's CPU platform (always available, as a CPU is) was probed with the out-of-tree
    platforms, before the accelerators: a CUDA node with it installed trained on the CPU, and beside another active
    plugin it was "more than one out-of-tree platform is active". It takes the CPU's place, last."""
    install_plugin("cpu", probe="return True")
    monkeypatch.setattr(CudaPlatform, "is_available", classmethod(lambda cls: True))
    assert resolve_platform() is CudaPlatform
    monkeypatch.setattr(CudaPlatform, "is_available", classmethod(lambda cls: False))
    for other in (RocmPlatform, NpuPlatform):
        monkeypatch.setattr(other, "is_available", classmethod(lambda cls: False))
    tuned = resolve_platform()
    assert tuned.__module__ == "roll_acme_raising_cpu" and resolve_platform("cpu") is tuned  # no accelerator: it runs
    install_plugin("acme", probe="return True")
    assert resolve_platform().__module__ == "roll_acme_raising_acme"  # an active vendor platform, not an error


def test_the_doctor_reports_a_raising_plugin_without_crashing(install_plugin) -> None:
    from roll_hw import doctor

    install_plugin("acme")
    text, ok = doctor.report()
    assert not ok and "ERROR: the probe of platform plugin 'acme'" in text
    assert re.search(r"^acme\s+\| error \(libacme_driver.so: cannot open shared object file\)$", text, re.M)
    assert "platform probes" in text and "optional engines" in text


class _Dist:
    def __init__(self, name: str) -> None:
        self.name = name


def test_two_plugins_declaring_one_name_are_an_error_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two distributions declaring `acme` with different targets: the dict of entry points kept whichever came last
    on sys.path, silently. Now loading `acme` (forced or auto-detected) names both and says what to do; an
    unrelated forced platform still resolves."""
    real = detect.entry_points
    first = EntryPoint(name="acme", value="acme_one:Platform", group=detect.GROUP)
    second = EntryPoint(name="acme", value="acme_two:Platform", group=detect.GROUP)
    # EntryPoint is immutable: the distribution is attached the way importlib.metadata does.
    for ep, dist in ((first, "acme-one"), (second, "acme-two")):
        vars(ep)["dist"] = _Dist(dist)
    monkeypatch.setattr(detect, "entry_points", lambda group: [*real(group=group), first, second])
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    detect.clear_cache()
    try:
        expected = r"'acme' is declared by more than one plugin \(acme_one:Platform from acme-one; acme_two:Platform "
        with pytest.raises(PlatformPluginError, match=expected + r"from acme-two\): uninstall all but one$"):
            detect.get_platform_class("acme")
        with pytest.raises(PlatformPluginError, match=expected + r".*set ROLL_PLATFORM=<platform>"):
            resolve_platform()
        assert resolve_platform("cpu") is CpuPlatform
        assert detect.platform_names().count("acme") == 1
    finally:
        monkeypatch.undo()
        detect.clear_cache()


@pytest.mark.parametrize("spelling", ["roll_hw", "Roll.HW"])
def test_roll_hw_metadata_spelled_otherwise_still_declares_the_built_ins(
    monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """A build whose metadata spells the distribution `roll_hw` is roll-hw (PEP 503 names compare normalised): its
    platforms stay built-ins in probe order, none is taken for a plugin."""
    real = detect.entry_points

    def respelled(group: str) -> list[EntryPoint]:
        out = []
        for ep in real(group=group):
            if ep.dist is not None and ep.dist.name == "roll-hw":
                ep = EntryPoint(name=ep.name, value=ep.value, group=ep.group)
                vars(ep)["dist"] = _Dist(spelling)  # attached the way importlib.metadata does
            out.append(ep)
        return out

    monkeypatch.setattr(detect, "entry_points", respelled)
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    detect.clear_cache()
    try:
        assert detect.builtin_names() == ["cuda", "rocm", "npu", "cpu"]
        assert not set(detect._declared()[1]) & {"cuda", "rocm", "npu", "cpu"}
        assert detect.get_platform_class("cpu") is CpuPlatform
    finally:
        monkeypatch.undo()
        detect.clear_cache()


def test_one_plugin_seen_twice_is_not_a_clash(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same target declared twice (one distribution on two sys.path entries) loads as one plugin (named as its
    class is: test_plugin_names)."""
    real = detect.entry_points
    ep = EntryPoint(name="cpu", value="roll_hw.cpu:CpuPlatform", group=detect.GROUP)
    monkeypatch.setattr(detect, "entry_points", lambda group: [*real(group=group), ep, ep])
    detect.clear_cache()
    try:
        assert detect.get_platform_class("cpu") is CpuPlatform
    finally:
        monkeypatch.undo()
        detect.clear_cache()
