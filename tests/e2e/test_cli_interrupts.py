"""roll-train as a user meets it on a first run and when interrupting it: real processes, real signals.

- Ctrl-C while the pipeline is built stops the build in one line, exit 130, even where the signal lands inside a
  `__del__` (Python prints and drops an exception raised there: the run trained every step and exited 0) or inside a
  Ray wait (Ray raises a bare KeyboardInterrupt: a traceback, exit 1). The Ray instance the run started is gone after,
  with every process the run started (found by a marker variable they inherit).
- A log file (stderr not a terminal) holds roll's one line per step, not transformers' progress bars; a terminal
  keeps them.
- A config error found inside the job is roll's message alone, without Hydra's `Error executing job with overrides`.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from roll_core.testing import tiny_overrides

BIN = Path(sys.executable).parent

#: roll-train whose build, once its run folder, tokenizer and task are ready, is held at argv[1] until the test's
#: SIGINT: `del` (the main thread spends its time inside `__del__` methods, until one sees the signal's exception go
#: through it; then it works outside them) or `ray` (waiting in ray.get on a task that never returns, as the build
#: waits on workers that start). argv[2] is the file written once the hold is reached.
DRIVER = """
import os, sys, threading, time
import roll_core.pipelines.loop as loop

hold, marker = sys.argv[1], sys.argv[2]
build_roles = loop.build_roles


class Busy:
    seen = False

    def __del__(self):
        end = time.monotonic() + 0.2
        try:
            while time.monotonic() < end:
                pass
        except BaseException:
            Busy.seen = True  # the signal's exception, which Python drops at the end of __del__
            raise


def held_build_roles(*args, **kwargs):
    open(marker, "w").close()
    deadline = time.monotonic() + 20
    if hold == "del":
        while not Busy.seen and time.monotonic() < deadline:
            Busy()
        while time.monotonic() < deadline:  # outside any __del__ now: a signal raised again lands here
            pass
    else:
        import ray

        @ray.remote(num_cpus=0)
        def never(path):
            open(path + ".task", "w").close()
            threading.Event().wait(600)

        ray.get(never.remote(marker))
    print("BUILD-CONTINUED", file=sys.stderr, flush=True)
    return build_roles(*args, **kwargs)


loop.build_roles = held_build_roles
from roll_core.cli import train_main

sys.argv = ["roll-train", *sys.argv[3:]]
train_main()
"""


def _marked(mark: str) -> list[str]:
    """The processes (pid and command) whose environment holds UXHUNT_MARK=`mark`: the run and all it started."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"UXHUNT_MARK={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
                found.append(f"{pid} {command!r}")
        except OSError:  # gone meanwhile, or not ours
            pass
    return found


def _wait_for(condition, what: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"roll-train exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def marked_env() -> Iterator[tuple[dict[str, str], str]]:
    """An environment for roll-train with a fresh marker; every marked process left is killed after the test."""
    mark = uuid.uuid4().hex
    yield {**os.environ, "UXHUNT_MARK": mark}, mark
    for line in _marked(mark):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass


def _held_run(tmp_path: Path, seven_task: Path, env: dict[str, str], hold: str, *extra: str) -> subprocess.Popen:
    marker = tmp_path / "held"
    overrides = tiny_overrides(seven_task, tmp_path / "run", "pipeline.max_steps=1", *extra)
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, hold, str(marker), *overrides],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _interrupted(proc: subprocess.Popen, ready: Path) -> tuple[str, float]:
    """SIGINT once `ready` exists; returns roll-train's stderr and how long it took to exit."""
    try:
        _wait_for(ready.exists, f"the build to reach {ready.name}", 120, proc)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        return err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_ctrl_c_python_drops_inside_a_del_still_stops_the_build(
    seven_task: Path, tmp_path: Path, marked_env: tuple[dict[str, str], str]
) -> None:
    """The signal's StoppedWhileBuilding raised inside a `__del__` (a weakref callback of torch while a model loads,
    1 Ctrl-C in 8 here): Python printed `Exception ignored in ...` and went on; the build finished and the run
    trained every step, exit 0."""
    env, _ = marked_env
    proc = _held_run(tmp_path, seven_task, env, "del")
    err, took = _interrupted(proc, tmp_path / "held")
    assert proc.returncode == 130, err[-3000:]
    assert "roll-train: stopped while building the pipeline (SIGINT)" in err, err[-3000:]
    assert "BUILD-CONTINUED" not in err and "Exception ignored" not in err and "Traceback" not in err, err[-3000:]
    assert took < 15, took
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.ray
def test_a_ctrl_c_while_the_build_waits_on_ray_is_one_line_and_stops_ray(
    seven_task: Path, tmp_path: Path, marked_env: tuple[dict[str, str], str]
) -> None:
    """Ray's waits run the signal handler themselves and raise a bare KeyboardInterrupt in place of its
    StoppedWhileBuilding: roll-train printed a KeyboardInterrupt traceback and exited 1. Every process of the Ray
    instance the run started (GCS, raylet, workers) is gone after."""
    env, mark = marked_env
    proc = _held_run(tmp_path, seven_task, env, "ray", "cluster=ray")
    err, took = _interrupted(proc, tmp_path / "held.task")
    assert proc.returncode == 130, err[-3000:]
    assert "roll-train: stopped while building the pipeline (SIGINT)" in err, err[-3000:]
    assert "Traceback" not in err and "BUILD-CONTINUED" not in err, err[-3000:]
    assert took < 30, took
    _wait_for(lambda: not _marked(mark), "the run's Ray processes to end", 30)


def _read_all(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every writer of the terminal closed it
            return
        if not chunk:
            return
        into.append(chunk)


def test_library_progress_bars_stay_out_of_a_log_file_and_show_on_a_terminal(seven_task: Path, tmp_path: Path) -> None:
    """stderr to a file: transformers' `Loading weights` / `Writing model shards` bars (tqdm's carriage-return
    updates, per model load and save) filled the log beside roll's one line per step. A terminal keeps them."""

    def command(out: str) -> list[str]:
        return [str(BIN / "roll-train"), *tiny_overrides(seven_task, tmp_path / out, "pipeline.max_steps=1")]

    # (A test that ran roll-train's entry in this process leaves the variables set: a user's choice to roll.)
    unset = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    log = subprocess.run(command("a"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert log.returncode == 0, log.stderr[-3000:]
    text = log.stdout + log.stderr
    assert "step 1/1 reward=" in text, text[-3000:]
    assert "Loading weights" not in text and "Writing model shards" not in text and "it/s]" not in text, text[-3000:]

    main, terminal = pty.openpty()
    # A window size: a new pseudo-terminal's is 0 columns, in which tqdm draws empty bars
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        proc = subprocess.Popen(command("b"), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=terminal)
    finally:
        os.close(terminal)
    shown: list[bytes] = []
    reader = threading.Thread(target=_read_all, args=(main, shown), daemon=True)
    reader.start()
    try:
        proc.communicate(timeout=300)
        reader.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        os.close(main)
    screen = b"".join(shown).decode(errors="replace")
    assert proc.returncode == 0, screen[-3000:]
    assert "Loading weights" in screen, screen[-3000:]


def test_a_config_error_found_in_the_job_is_roll_s_message_alone(tmp_path: Path) -> None:
    """Errors raised inside Hydra's job (the typed config's checks, the pipeline's) came after Hydra's own line
    `Error executing job with overrides: [...]`; the message is roll's, exit 2."""
    proc = subprocess.run(
        [str(BIN / "roll-train"), "pipeline.max_steps=-1", f"pipeline.output_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == "roll-train: invalid config:\npipeline.max_steps=-1 must be > 0\n", proc.stderr[-3000:]
