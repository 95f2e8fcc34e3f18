"""A platform plugin's class `name` is the name it is declared under: a Ray driver hands `platform.name` to its
workers (roll_core.pipelines.wiring), which resolve the platform by that name. Plugins are installed through a real
`roll.platforms` entry point (a module written to a temporary folder); `roll-doctor` lists them as detect reads them.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from roll_hw import PlatformPluginError, detect, doctor, resolve_platform
from roll_hw.cpu import CpuPlatform

_PLUGIN = '''
from roll_hw.cuda import CudaPlatform


class AcmeGpu(CudaPlatform):
    """A vendor's CUDA variant, available here (no GPU needed)."""

    {name_line}

    @classmethod
    def is_available(cls):
        return True
'''


class _Dist:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def declare(platform_plugins):
    """Declare `AcmeGpu` (a module on sys.path) as platform `entry`, its class's `name` set by `name_line`."""

    def install(entry: str, name_line: str) -> None:
        module = f"roll_acme_named_{entry}"
        platform_plugins.install(entry, module, _PLUGIN.format(name_line=name_line), "AcmeGpu")

    return install


def test_a_plugin_whose_class_keeps_another_platforms_name_is_an_error_naming_it(declare) -> None:
    """Declared `acme`, its class kept CudaPlatform's name `cuda`: the driver detected it, and its workers, told
    "cuda", ran roll-hw's own CUDA platform (or failed: "platform 'cuda' requested is unavailable"). Now loading it is
    an error naming the entry point, the class, both names and the fix; a run that names another platform goes on."""
    declare("acme", "# name not set: CudaPlatform's")
    with pytest.raises(PlatformPluginError) as err:
        resolve_platform()
    message = str(err.value)
    assert "entry point roll.platforms:acme (roll_acme_named_acme:AcmeGpu)" in message
    assert "roll_acme_named_acme.AcmeGpu, whose name is 'cuda'" in message and "set name = 'acme'" in message
    with pytest.raises(PlatformPluginError, match=r"whose name is 'cuda'.*set name = 'acme'$"):
        detect.get_platform_class("acme")
    assert resolve_platform("cpu") is CpuPlatform


def test_a_plugin_named_as_declared_resolves_by_its_name_in_a_worker(declare) -> None:
    """What a worker does with the driver's platform: resolve it again by `name`; it is the plugin's class."""
    declare("acme", 'name = "acme"')
    driver = resolve_platform()
    assert driver.__module__ == "roll_acme_named_acme" and driver.name == "acme"
    assert resolve_platform(driver.name) is driver


def test_a_plugin_replacing_a_built_in_under_its_name_loads(declare) -> None:
    """A replacement of `cuda` whose class inherits the name `cuda` is named as declared: no error."""
    declare("cuda", "# name inherited: cuda, as declared")
    assert detect.get_platform_class("cuda").__module__ == "roll_acme_named_cuda"


def test_the_doctor_shows_a_replacement_of_roll_hw_spelled_roll_hw_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """roll-hw's metadata spelled `roll_hw` (detect compares PEP 503 names) beside a plugin declaring `cuda`: detect
    loads the plugin in place of the built-in, and the doctor showed "CLASH: declared by acme and roll_hw"."""
    import importlib.metadata as metadata

    real = metadata.entry_points

    def respelled(group: str) -> list[EntryPoint]:
        out = []
        for ep in real(group=group):
            if ep.dist is not None and ep.dist.name == "roll-hw":
                ep = EntryPoint(name=ep.name, value=ep.value, group=ep.group)
                vars(ep)["dist"] = _Dist("roll_hw")  # attached the way importlib.metadata does
            out.append(ep)
        if group == detect.GROUP:
            acme = EntryPoint(name="cuda", value="acme_gpu:AcmeGpu", group=group)
            vars(acme)["dist"] = _Dist("acme")
            out.append(acme)
        return out

    monkeypatch.setattr(metadata, "entry_points", respelled)
    listed = doctor._plugins(detect.GROUP)
    assert "cuda (acme; replaces roll-hw's)" in listed and "CLASH" not in listed
    assert "cpu (roll_hw)" in listed
