"""Two processes never write one run folder (roll_core.run_lock), end to end on the tiny model: a pipeline built on a
folder another process holds (a requeued job while the old one lives, `pipeline.resume=true` launched twice) is
refused before it writes anything, a SIGKILLed holder leaves the folder free, and a run restart in one process keeps
the folder locked across its rebuild."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from roll_core.cluster.group import WorkerDiedError
from roll_core.config import load_config
from roll_core.errors import ConfigError
from roll_core.pipelines.run_control import run_with_restarts
from roll_core.run_lock import LOCK_NAME
from roll_core.testing import run_pipeline, tiny_overrides

#: Another process: takes the lock on argv[1] (exit 3 when refused), says HELD, holds it argv[2] seconds.
SCRIPT = """
import os, sys, time
from roll_core.errors import ConfigError
from roll_core.run_lock import hold_run_folder
try:
    lock = hold_run_folder(sys.argv[1])
except ConfigError as e:
    print("REFUSED", e, flush=True)
    sys.exit(3)
print("HELD", os.getpid(), flush=True)
time.sleep(float(sys.argv[2]))
"""


def _try_lock(folder: Path) -> int:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(folder), "0"], capture_output=True, timeout=60).returncode


def test_a_held_run_folder_is_refused_and_a_restart_keeps_the_lock(seven_task: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    base = tiny_overrides(seven_task, run, "pipeline.max_steps=2", "pipeline.save_every=1")
    holder = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(run), "600"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert holder.stdout.readline().split() == ["HELD", str(holder.pid)]
        for extra in ([], ["pipeline.resume=true"]):  # a second launch, fresh or resuming
            with pytest.raises(ConfigError, match=rf"{run} is in use by another roll process \(pid {holder.pid} on "):
                run_pipeline([*base, *extra])
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing written: no metrics, no checkpoint
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        holder.stdout.close()

    from roll_core.cli import pipeline_class

    probes: list[int] = []

    def make(cfg: Any) -> Any:
        if cfg.pipeline.resume_from:  # the restart: the failed incarnation is shut down, the new one not built yet
            probes.append(_try_lock(run))
        pipeline = pipeline_class(cfg.pipeline.name)(cfg)
        if not cfg.pipeline.resume_from:
            step = pipeline.step

            def failing_step(n: int) -> dict[str, Any]:
                if n == 2:
                    raise WorkerDiedError("actor_train rank 0 died")
                return step(n)

            pipeline.step = failing_step
        return pipeline

    summary = run_with_restarts(make, load_config(base))  # the killed holder left the folder free
    assert summary["run_restarts"] == 1
    assert probes == [3]  # between the incarnations another process was refused: the lock was kept
    assert _try_lock(run) == 0  # and given back when the run ended
