"""A run folder another live process holds the run-folder lock on (roll_core.run_lock), for tests of what a second
run into it is refused: `folder_held_elsewhere(folder)` makes `folder` with the `.hydra/config.yaml` its running run
wrote, starts a process holding the lock, yields once the lock is held, and kills that process at the end."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The holder: takes the lock, says so, then sleeps until it is killed (10 minutes at most).
HOLDER = """
import sys, time
from roll_core.run_lock import hold_run_folder
lock = hold_run_folder(sys.argv[1])
print("HELD", flush=True)
time.sleep(600)
"""


@contextmanager
def folder_held_elsewhere(folder: Path) -> Iterator[Path]:
    """`folder`, locked by another live process, with what its run has written so far (see the module docstring)."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("algo: {lr: 1.0e-06}  # the running run's\n")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD"
        yield folder
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
