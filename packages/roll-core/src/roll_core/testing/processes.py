"""Process checks for tests that kill a parent and watch what it started (Linux `/proc`)."""

from __future__ import annotations

from pathlib import Path


def process_gone(pid: int) -> bool:
    """Whether `pid` has exited: no such process, or a zombie (one waiting for an init that does not reap it counts
    as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
