"""Fixtures shared by the plugin tests: roll-doctor's output, produced once for the session."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def doctor_output() -> str:
    """What `python -m roll_hw` (roll-doctor) prints with the out-of-tree dummy platform active (ROLL_DUMMY_PLATFORM=1,
    no ROLL_PLATFORM): its platform table shows the dummy platform, and its plugin tables list every installed
    plugin whatever the platform. One run serves every plugin test that reads it (~3 s a run on 2 cores: it
    imports torch; the optional engines' versions come from package metadata)."""
    env = dict(os.environ, ROLL_DUMMY_PLATFORM="1")
    env.pop("ROLL_PLATFORM", None)
    proc = subprocess.run([sys.executable, "-m", "roll_hw"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
