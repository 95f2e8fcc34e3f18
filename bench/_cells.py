"""Bench cells in fresh processes: each measurement runs in its own Python so that one cell's threads, allocator
state and compiled kernels never colour the next one's timing (and a crash costs one cell, not the table).

Contract: the child prints `emit(result)` (one line `RESULT <json>`); the parent's `run_cell(cmd)` returns that
JSON, or None and a line saying why (exit status and the tail of its stderr).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

PREFIX = "RESULT "


def emit(result: Any) -> None:
    """Print `result` as the cell's answer (the last such line wins)."""
    print(PREFIX + json.dumps(result), flush=True)


def run_cell(cmd: list[str], tail: int = 1500, env: dict[str, str] | None = None) -> tuple[Any, str]:
    """Run `cmd` (a Python command line ending in a cell's arguments; `env`: its environment, else this one's);
    (its result, "") or (None, why it failed)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode or not lines:
        return None, f"failed ({proc.returncode}): {proc.stderr[-tail:]}"
    return json.loads(lines[-1].removeprefix(PREFIX)), ""
