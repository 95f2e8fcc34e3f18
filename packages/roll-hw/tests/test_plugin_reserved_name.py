"""`auto` is no platform's name: ROLL_PLATFORM=auto and hw.platform=auto mean auto-detection, so a plugin declared
under it could never be chosen by name, and workers handed its `name` ("auto") would run detection again. Such a
plugin is a PlatformPluginError naming it. The plugin is installed for real: a distribution's metadata (dist-info with
entry_points.txt) and its module in a temporary folder on sys.path, read by importlib.metadata as pip's would be."""

from __future__ import annotations

import pytest

from roll_hw import PlatformPluginError, detect, resolve_platform

_MODULE = '''
from roll_hw.cpu import CpuPlatform


class AutoNamed(CpuPlatform):
    """Available anywhere (no accelerator needed), named as declared."""

    name = "{name}"
'''


@pytest.fixture
def install(platform_plugins):
    """`install(entry)`: a distribution `acme-{entry}` declaring `AutoNamed` as `roll.platforms:{entry}`."""

    def put(entry: str) -> None:
        module = f"roll_acme_reserved_{entry}"
        platform_plugins.install(entry, module, _MODULE.format(name=entry), "AutoNamed", dist=f"acme-{entry}")

    return put


def test_a_plugin_declared_as_auto_is_an_error_naming_it(install) -> None:
    install("auto")
    for name in (None, "auto", "cpu"):  # detection, auto named, and a run that names another platform
        with pytest.raises(PlatformPluginError) as err:
            resolve_platform(name)
        message = str(err.value)
        assert "roll.platforms:auto (roll_acme_reserved_auto:AutoNamed from acme-auto)" in message, message
        assert "reserved name 'auto'" in message and "declare it under a name of its own" in message
    with pytest.raises(PlatformPluginError, match="reserved name 'auto'"):
        detect.platform_names()


def test_a_plugin_under_its_own_name_still_resolves(install) -> None:
    """The same installation under another name is a platform (the check refuses `auto` only)."""
    install("autoish")
    assert "autoish" in detect.platform_names()
    assert resolve_platform("autoish").__module__ == "roll_acme_reserved_autoish"
