"""`roll-doctor`'s list of installed plugins shows every distribution that declares a name: a platform plugin that
replaces a built-in (detection runs the plugin's class) or two packages declaring one name (an error where loaded)
must be visible there, not hidden behind whichever distribution came last on sys.path; the replacement is also
logged once per process, for run logs."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from roll_hw import detect, doctor


def _install_dist(root: Path, dist: str, group: str, entries: dict[str, str]) -> None:
    """A real installed distribution (a .dist-info folder on sys.path) declaring `entries` in `group`."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")


#: A replacement of roll-hw's cuda (a CPU under the name, so it runs here): a platform is named as declared.
_ACME_CUDA = "from roll_hw.cpu import CpuPlatform\n\n\nclass AcmeCuda(CpuPlatform):\n    name = 'cuda'\n"


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    (tmp_path / "roll_acme_doctor_cuda.py").write_text(_ACME_CUDA)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    detect.clear_cache()
    yield tmp_path
    monkeypatch.undo()
    detect.clear_cache()
    sys.modules.pop("roll_acme_doctor_cuda", None)


def test_a_platform_plugin_that_replaces_a_builtin_is_shown_replacing_it(site: Path) -> None:
    _install_dist(site, "acme-gpu", detect.GROUP, {"cuda": "roll_acme_doctor_cuda:AcmeCuda"})
    assert detect.get_platform_class("cuda").__qualname__ == "AcmeCuda"  # the plugin's class runs as "cuda"
    listed = doctor._plugins(detect.GROUP).split(", ")
    assert "cuda (acme-gpu; replaces roll-hw's)" in listed
    assert "cpu (roll-hw)" in listed  # names declared once are listed as before


def test_a_name_two_packages_declare_is_shown_as_a_clash(site: Path) -> None:
    _install_dist(site, "acme-one", "roll.rewards", {"acme_score": "acme_one:score"})
    _install_dist(site, "acme-two", "roll.rewards", {"acme_score": "acme_two:score"})
    listed = doctor._plugins("roll.rewards").split(", ")
    assert "acme_score (CLASH: declared by acme-one and acme-two)" in listed


def test_a_platform_plugin_that_replaces_a_builtin_is_logged_once(
    site: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run logs said nothing: "cuda" ran another package's class with no line naming it (only roll-doctor did)."""
    monkeypatch.setattr(detect, "_replacements_logged", set(), raising=False)  # as in a fresh process
    _install_dist(site, "acme-gpu", detect.GROUP, {"cuda": "roll_acme_doctor_cuda:AcmeCuda"})
    with caplog.at_level(logging.INFO, logger="roll_hw.detect"):
        assert detect.get_platform_class("cuda").__qualname__ == "AcmeCuda"
        detect.clear_cache()  # loaded again (a second resolution in the process): not logged again
        assert detect.get_platform_class("cuda").__qualname__ == "AcmeCuda"
        detect.get_platform_class("cpu")  # roll-hw's own: nothing to say
    lines = [r.getMessage() for r in caplog.records if r.name == "roll_hw.detect"]
    assert lines == [
        "platform 'cuda' is the plugin roll_acme_doctor_cuda:AcmeCuda from acme-gpu, replacing roll-hw's built-in "
        "'cuda' (roll_hw.cuda:CudaPlatform)"
    ]
