"""Fixtures shared by roll-hw's tests.

`platform_plugins`: installs out-of-tree platform plugins for one test, for real (a module written to the test's
temporary folder, put on sys.path) with ROLL_PLATFORM unset, and removes them afterwards (sys.path, the patched
entry points, detect's cache, the modules imported). See `PlatformPlugins.install`.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from roll_hw import detect


class PlatformPlugins:
    """The plugins a test installed (`modules`), in `folder` (on sys.path once one is installed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
        self.monkeypatch, self.folder = monkeypatch, folder
        self.modules: list[str] = []

    def install(self, entry: str, module: str, source: str, cls: str, dist: str | None = None) -> None:
        """Write `source` (dedented) as module `module` and declare `module:cls` as `roll.platforms:entry`: with
        `dist`, in that distribution's metadata (a dist-info folder with entry_points.txt beside the module, read by
        importlib.metadata as pip's would be); without, as one more entry point of detect's `entry_points`."""
        (self.folder / f"{module}.py").write_text(textwrap.dedent(source))
        if dist is not None:
            info = self.folder / f"{dist.replace('-', '_')}-0.1.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
            (info / "entry_points.txt").write_text(f"[{detect.GROUP}]\n{entry} = {module}:{cls}\n")
        self.monkeypatch.syspath_prepend(str(self.folder))
        if dist is None:
            real = detect.entry_points
            ep = EntryPoint(name=entry, value=f"{module}:{cls}", group=detect.GROUP)
            self.monkeypatch.setattr(detect, "entry_points", lambda group: [*real(group=group), ep])
        detect.clear_cache()
        self.modules.append(module)


@pytest.fixture
def platform_plugins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[PlatformPlugins]:
    """`platform_plugins.install(entry, module, source, cls, dist=None)`: a platform plugin for this test alone."""
    monkeypatch.delenv(detect.ENV_VAR, raising=False)
    plugins = PlatformPlugins(monkeypatch, tmp_path)
    yield plugins
    monkeypatch.undo()
    detect.clear_cache()
    for module in plugins.modules:
        sys.modules.pop(module, None)
