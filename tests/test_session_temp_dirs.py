"""The test session's temporary files (root conftest.py): the processes the tests start write theirs into one
folder of the session, and the test process removes that folder and its own temporary folders before it leaves
with `os._exit` (which skips the finalizers that would). A CI run on a shared machine left ~50 folders in /tmp
before (multiprocessing's pymp-*, wandb's media, artifact and table folders, vLLM sockets, a sandbox folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_processes_the_tests_start_write_temporary_files_into_the_session_folder() -> None:
    folder = os.environ["ROLL_TEST_TMPDIR"]
    assert os.environ["TMPDIR"] == folder and Path(folder).is_dir()
    assert Path(folder).name.startswith("roll-tests-")
    # The first pytest process keeps /tmp (pytest's tmp_path lives there); pytest-xdist's workers inherit the folder.
    assert tempfile.gettempdir() in (str(Path(folder).parent), folder)
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"], **_text())
    assert child.stdout.strip() == folder
    assert os.environ["VLLM_RPC_BASE_PATH"] == os.path.join(folder, "vllm")
    assert os.environ["HF_MODULES_CACHE"] == os.path.join(folder, "hf_modules")


_SCRIPT = """
import importlib.util, json, os, sys, tempfile
from multiprocessing.connection import Listener
from multiprocessing import util
spec = importlib.util.spec_from_file_location("root_conftest", sys.argv[1])
conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conftest)
session = os.environ["ROLL_TEST_TMPDIR"]
kept = tempfile.TemporaryDirectory(dir=sys.argv[2])  # alive: its finalizer would run only at a normal exit
listener = Listener(family="AF_UNIX")  # makes multiprocessing's pymp-* folder
made = {"session": session, "kept": kept.name, "pymp": util.get_temp_dir()}
conftest._remove_own_temp_dirs()
print(json.dumps({k: os.path.exists(v) for k, v in made.items()} | {"new_session": session != sys.argv[3]}))
"""


def test_the_session_folder_and_the_folders_a_process_keeps_are_removed(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ROLL_TEST_TMPDIR", "VLLM_RPC_BASE_PATH")}
    env["TMPDIR"] = str(tmp_path)  # the child's own session folder is made here, not in /tmp
    cmd = [sys.executable, "-c", _SCRIPT, str(ROOT / "conftest.py"), str(tmp_path), os.environ["ROLL_TEST_TMPDIR"]]
    out = subprocess.run(cmd, env=env, cwd=ROOT, **_text())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "session": False,
        "kept": False,
        "pymp": False,
        "new_session": True,
    }
    assert list(tmp_path.iterdir()) == []


def _text() -> dict:
    return {"capture_output": True, "text": True, "timeout": 120}
