"""A signal to the whole process group (Ctrl-C in a terminal; `kill -TERM -<pgid>` from a scheduler, `timeout`,
`docker stop`) stops a `roll-train cluster=ray` run as a signal to the driver alone does: the step finishes, its
checkpoint is saved, exit 128 + N, and the local Ray instance the run started is shut down with it.

`roll-train` runs in a session of its own (its process group is the terminal's foreground one) and signals its own
group from inside a step, at a chosen step. Ray's GCS and raylet were in that group: the SIGTERM killed them under the
stopping run, which then hung 60 s on the dead GCS until Ray ended the process (exit 1, the run folder's lock never
released), and any call the step still made through them failed (roll_core.cluster.launch.own_session).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from roll_core.checkpoint import CheckpointManager
from roll_core.testing import tiny_overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow]

#: roll-train sending argv[1] to its own process group at the start of step argv[2]'s update, after writing the Ray
#: processes it started then (pid, start time, name) to argv[3] as JSON.
DRIVER = """
import json, os, signal, sys
import psutil
from roll_core.pipelines.trainer import Trainer

update = Trainer.update
sig, at, ray_file = signal.Signals[sys.argv[1]], int(sys.argv[2]), sys.argv[3]

def group_signalling_update(self, step, *args, **kwargs):
    if step == at:
        procs = [(p.pid, p.create_time(), p.name()) for p in psutil.Process().children(recursive=True)]
        with open(ray_file, "w") as f:
            json.dump(procs, f)
        os.killpg(os.getpgrp(), sig)
    return update(self, step, *args, **kwargs)

Trainer.update = group_signalling_update
from roll_core.cli import train_main

sys.argv = ["roll-train", *sys.argv[4:]]
train_main()
"""


def _left_running(procs: list[list], wait_s: float = 20.0) -> list[str]:
    """The processes of `procs` still running (zombies count as gone: their parent, Ray's raylet, is), waiting up to
    `wait_s` for a shutdown's kills to land."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid, started, name in procs:
            try:
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{name} ({pid})")
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _stop_with_group_signal(sig: signal.Signals, at: int, run: Path, tmp_path: Path, *overrides: str) -> list[list]:
    """Launch the run, signal its group in step `at`, check it stopped after that step with its checkpoint saved and
    Ray shut down; returns the Ray processes the run had started."""
    ray_file = tmp_path / f"ray-{sig.name}.json"
    p = subprocess.run(
        [sys.executable, "-c", DRIVER, sig.name, str(at), str(ray_file), *overrides],
        capture_output=True,
        text=True,
        timeout=400,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    assert p.returncode == 128 + sig, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr and "Failed to connect to GCS" not in p.stderr, p.stderr[-3000:]
    summary = json.loads(p.stdout[p.stdout.rindex("\n{") + 1 :])
    assert summary["stopped_by_signal"] == sig
    assert summary["status"] == f"stopped by signal {int(sig)} (resume from step_{at:06d})"
    latest = CheckpointManager(run).latest()
    assert latest == run / "checkpoints" / f"step_{at:06d}" and (latest / "state.json").is_file()
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert (run / ".roll.lock").read_text() == ""  # released: the resume below may take the folder
    procs = json.loads(ray_file.read_text())
    assert {"gcs_server", "raylet"} <= {name for _, _, name in procs}, procs  # Ray's own processes were seen
    assert _left_running(procs) == []
    return procs


def test_a_signal_to_the_process_group_stops_a_ray_run_with_its_checkpoint(seven_task: Path, tmp_path: Path) -> None:
    """SIGTERM to the group in step 2 (it failed: exit 1 after a 60 s hang, lock kept); the run resumed from step 2's
    checkpoint, then Ctrl-C's SIGINT to the group in step 3. Two launches, one Ray start each."""
    run = tmp_path / "run"
    overrides = tiny_overrides(seven_task, run, "cluster=ray", "pipeline.max_steps=4", "pipeline.save_every=1")
    _stop_with_group_signal(signal.SIGTERM, 2, run, tmp_path, *overrides)
    _stop_with_group_signal(signal.SIGINT, 3, run, tmp_path, *overrides, "pipeline.resume=true")
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # resumed after step 2: every step once
