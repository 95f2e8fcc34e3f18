"""Fixtures shared by roll-envs' tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def sandboxed_program_pids(root: int | None = None) -> list[int]:
    """Pids of the sandboxed programs that process `root` (default: this one) runs now: its descendants whose
    interpreter carries CHILD_MARKER (bwrap's own processes do not count, nor a concurrent test session's)."""
    from roll_envs.sandbox import CHILD_MARKER

    root = os.getpid() if root is None else root
    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if CHILD_MARKER.encode() not in argv or argv[0].endswith(b"bwrap"):
                continue
            ancestor = pid
            while ancestor > 1 and ancestor != root:
                ancestor = _parent(ancestor)
        except (OSError, ValueError, IndexError):
            continue
        if ancestor == root:
            found.append(pid)
    return found


@pytest.fixture
def running_programs() -> Callable[[], int]:
    """`running_programs()`: how many sandboxed programs this test process runs right now."""
    return lambda: len(sandboxed_program_pids())


@pytest.fixture
def program_pids() -> Callable[[int | None], list[int]]:
    """`program_pids(root)`: pids of the sandboxed programs process `root` runs now (see `sandboxed_program_pids`)."""
    return sandboxed_program_pids
