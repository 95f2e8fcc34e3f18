"""The README's `-n 2 --dist loadfile` run ends after a worker dies (tests/xdist_loadfile.py).

pytest-xdist 3.8.0's LoadFileScheduling requeued a dead worker's finished modules as empty batches that never
complete and ran the test that killed the worker again: the session hung with every worker idle (the CI runs of
2026-12-07, to their 90-minute limit). A child pytest over four small modules, one of whose tests ends its worker's
process, must end within a minute: the crashed test failed once, every other test passed once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

HOOK = Path(__file__).with_name("xdist_loadfile.py")

CONFTEST = f"""
import importlib.util

import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    spec = importlib.util.spec_from_file_location("roll_xdist_loadfile", {str(HOOK)!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_scheduler(config, log)
"""

MODULES = {
    "test_a.py": "def test_a1(): pass\ndef test_a2(): pass\ndef test_a3(): pass\n",
    "test_b.py": "import os\ndef test_b_crash(): os._exit(1)\ndef test_b_after(): pass\n",
    "test_c.py": "def test_c_alone(): pass\n",
    "test_d.py": "def test_d1(): pass\ndef test_d2(): pass\n",
}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dead_worker_does_not_hang_the_run(workers: int, tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "ROLL_TEST"))}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", str(workers)]
    try:
        out = subprocess.run(
            [*cmd, "--dist", "loadfile", "-o", "addopts=", "-o", "timeout=0"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the run hung after its worker died:\n{exc.stdout}")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "1 failed, 7 passed" in text, text
    assert "test_b.py::test_b_crash" in text and "crashed" in text, text
