"""`roll-doctor`'s list of installed plugins shows every distribution that declares a name: a platform plugin that
replaces a built-in (detection runs the plugin's class) or two packages declaring one name (an error where loaded)
must be visible there, not hidden behind whichever distribution came last on sys.path."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_hw import detect, doctor
from roll_hw.cpu import CpuPlatform


def _install_dist(root: Path, dist: str, group: str, entries: dict[str, str]) -> None:
    """A real installed distribution (a .dist-info folder on sys.path) declaring `entries` in `group`."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    detect.clear_cache()
    yield tmp_path
    monkeypatch.undo()
    detect.clear_cache()


def test_a_platform_plugin_that_replaces_a_builtin_is_shown_replacing_it(site: Path) -> None:
    _install_dist(site, "acme-gpu", detect.GROUP, {"cuda": "roll_hw.cpu:CpuPlatform"})
    assert detect.get_platform_class("cuda") is CpuPlatform  # the plugin's class runs as "cuda"
    listed = doctor._plugins(detect.GROUP).split(", ")
    assert "cuda (acme-gpu; replaces roll-hw's)" in listed
    assert "cpu (roll-hw)" in listed  # names declared once are listed as before


def test_a_name_two_packages_declare_is_shown_as_a_clash(site: Path) -> None:
    _install_dist(site, "acme-one", "roll.rewards", {"acme_score": "acme_one:score"})
    _install_dist(site, "acme-two", "roll.rewards", {"acme_score": "acme_two:score"})
    listed = doctor._plugins("roll.rewards").split(", ")
    assert "acme_score (CLASH: declared by acme-one and acme-two)" in listed
