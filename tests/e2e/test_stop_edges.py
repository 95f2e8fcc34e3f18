"""Stop signals at the edges of a run: after a stopped run said so, while it exits; and late in its build.

- A second Ctrl-C while a stopped run exits (Python's shutdown: torch's and Ray's atexit callbacks) printed
  `Exception ignored in atexit callback: <function _del_library ...>` and a KeyboardInterrupt traceback. It now says
  in one line that the process is exiting, the exit status stays 128 + N, and a third Ctrl-C still kills a hung exit.
- A stop whose StoppedWhileBuilding a library swallowed (an `except BaseException` around a callback) after the
  build's last `rearm()` was lost: the run trained every step and exited 0. The end of the build raises it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing import tiny_overrides

#: roll-train that stops itself with a SIGINT before its first step (the stop line, then exit 130) and whose exit is
#: held in an atexit callback (Python's shutdown, as torch's `_del_library` is): argv[1] is written once the exit is
#: held, argv[2] is the file whose existence releases it.
DRIVER = """
import atexit, os, signal, sys, time

held, release = sys.argv[1], sys.argv[2]


def hold_exit():
    open(held, "w").close()
    end = time.monotonic() + 60
    while time.monotonic() < end and not os.path.exists(release):
        time.sleep(0.01)


atexit.register(hold_exit)  # registered first: run last, after the libraries' own callbacks
from roll_core.pipelines.loop import Pipeline

run_steps = Pipeline._run_steps


def stopped_run_steps(self, stop):
    signal.raise_signal(signal.SIGINT)  # the user's first Ctrl-C: the run stops before step 1
    return run_steps(self, stop)


Pipeline._run_steps = stopped_run_steps
from roll_core.cli import train_main

sys.argv = ["roll-train", *sys.argv[3:]]
train_main()
"""

NOTE = "roll-train: the run is over, exiting (Ctrl-C again kills it now)"


def _wait_for(condition: Any, what: str, timeout: float, proc: subprocess.Popen, err: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None and not condition():
            raise AssertionError(f"roll-train exited ({proc.returncode}) before {what}: {''.join(err)[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {''.join(err)[-3000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("then", ["release", "third_ctrl_c"])
def test_a_second_ctrl_c_while_a_stopped_run_exits_is_one_line_and_a_third_kills(
    seven_task: Path, tmp_path: Path, then: str
) -> None:
    held, release = tmp_path / "held", tmp_path / "release"
    overrides = tiny_overrides(seven_task, tmp_path / "run", "pipeline.max_steps=2")
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(held), str(release), *overrides],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # the log's stop line, the summary, Python's shutdown messages: in their order
        text=True,
    )
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        _wait_for(held.exists, "its exit to be held", 240, proc, err)
        proc.send_signal(signal.SIGINT)  # the second Ctrl-C, while Python shuts down
        _wait_for(lambda: any(NOTE in line for line in err), "the exiting line", 30, proc, err)
        if then == "release":
            release.touch()
            proc.wait(timeout=60)
            assert proc.returncode == 130, "".join(err)[-3000:]
        else:
            proc.send_signal(signal.SIGINT)  # a hung exit can still be killed
            proc.wait(timeout=30)
            assert proc.returncode == -signal.SIGINT, "".join(err)[-3000:]
        reader.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(err)
    assert "stopped before step 1" in text, text[-3000:]
    assert "Exception ignored" not in text and "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert text.count(NOTE) == 1, text[-3000:]


def test_a_stop_a_library_swallowed_after_the_build_s_last_rearm_still_stops_it(
    seven_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real build, the real BuildStop: the SIGINT lands in the trainer's set-up (after the last `rearm()`), where
    a library's `except BaseException` swallows its StoppedWhileBuilding. The build used to finish (and the run to
    train every step, exit 0); it stops at the build's end instead and shuts down what it started."""
    from roll_core.config import load_config
    from roll_core.pipelines import loop
    from roll_core.pipelines.run_control import StoppedWhileBuilding
    from roll_core.run_lock import hold_run_folder

    real, swallowed = loop.Trainer, []

    def late_step(*args: Any, **kwargs: Any) -> Any:
        try:
            signal.raise_signal(signal.SIGINT)
        except BaseException as exc:  # a library's handler around a callback
            swallowed.append(exc)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "Trainer", late_step)
    cfg = load_config(tiny_overrides(seven_task, tmp_path / "run", "pipeline.max_steps=1"))
    with pytest.raises(StoppedWhileBuilding) as info:
        loop.Pipeline(cfg)
    assert [type(e) for e in swallowed] == [StoppedWhileBuilding]
    assert info.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are the caller's again
    hold_run_folder(tmp_path / "run").release()  # the stopped build released the run folder's lock
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_caught_stop_exit_leaves_the_caller_s_handlers() -> None:
    """A caller that catches roll-train's SystemExit and goes on (a test, a notebook) keeps its own SIGINT/SIGTERM
    handlers: the exiting ones are installed only when Python shuts down."""
    from roll_core.cli import _exit_stopped

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        _exit_stopped(130)
    assert info.value.code == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_signal_inside_ray_init_is_raised_once_ray_init_returns() -> None:
    """Raised inside `ray.init` (in Ray's CoreWorker constructor, where a slow start spends its seconds), the stop
    left a half-made core worker `ray.shutdown()` could not see: destroyed at exit while its threads ran, the process
    ended in a segmentation fault (exit -11) after the stop line, 10 times in 11 here. It is raised at the `rearm()`
    after ray.init instead."""
    from roll_core.pipelines.run_control import BuildStop, StoppedWhileBuilding

    ray_worker: dict[str, Any] = {"__name__": "ray._private.worker", "signal": signal}
    # Frames of ray._private.worker: connect (the CoreWorker constructor) inside init.
    exec("def connect(step):\n    return step()\ndef init(step):\n    return connect(step)\n", ray_worker)
    reached: list[str] = []
    with pytest.raises(StoppedWhileBuilding) as info:
        with BuildStop() as building:
            ray_worker["init"](lambda: (signal.raise_signal(signal.SIGINT), reached.append("connected")))
            reached.append("init returned")
            building.rearm()
            reached.append("built on")
    assert reached == ["connected", "init returned"] and info.value.signum == signal.SIGINT


def test_a_signal_in_ray_init_s_wait_for_a_cluster_is_raised_at_once() -> None:
    """Only the connection defers the stop: ray.init's wait for a cluster that does not answer retries for minutes,
    and a stop deferred there waited as long (a second Ctrl-C was needed)."""
    from roll_core.pipelines.run_control import BuildStop, StoppedWhileBuilding

    ray_worker: dict[str, Any] = {"__name__": "ray._private.worker", "signal": signal}
    exec("def init(step):\n    return step()\n", ray_worker)  # init's own frame, no connect
    reached: list[str] = []
    with pytest.raises(StoppedWhileBuilding):
        with BuildStop():
            ray_worker["init"](lambda: (signal.raise_signal(signal.SIGINT), reached.append("waited on")))
    assert reached == []


def test_an_error_after_a_deferred_stop_is_reported_as_the_stop() -> None:
    """A stop deferred inside ray.init, then Ray's own error (it could not connect): the error escaped the build as a
    failed run (exit 1) and the stop was lost; it is the stop (exit 130/143) with the error as its cause."""
    from roll_core.pipelines.run_control import BuildStop, StoppedWhileBuilding

    ray_worker: dict[str, Any] = {"__name__": "ray._private.worker", "signal": signal}
    exec("def connect():\n    signal.raise_signal(signal.SIGINT)\n    raise ConnectionError('no GCS')\n", ray_worker)
    with pytest.raises(StoppedWhileBuilding) as info:
        with BuildStop():
            ray_worker["connect"]()
    assert info.value.signum == signal.SIGINT and isinstance(info.value.__cause__, ConnectionError)


def test_a_swallowed_abort_does_not_let_the_build_finish() -> None:
    """Two signals a library swallowed (the stop, then the abort): check() raised nothing once the abort was
    recorded, so the build finished and training started."""
    from roll_core.pipelines.run_control import BuildStop

    with pytest.raises(KeyboardInterrupt) as info:
        with BuildStop() as building:
            for _ in range(2):
                try:
                    signal.raise_signal(signal.SIGINT)
                except BaseException:  # a library's catch-all
                    pass
            building.check()
    assert type(info.value) is KeyboardInterrupt


@pytest.mark.ray
def test_a_ctrl_c_inside_ray_s_core_worker_constructor_exits_130_without_a_crash(
    seven_task: Path, tmp_path: Path
) -> None:
    """The real ray.init, the Ctrl-C delivered at the end of Ray's CoreWorker constructor (where it landed)."""
    driver = """
import signal, sys
import ray._raylet

class CoreWorker(ray._raylet.CoreWorker):
    def __init__(self, *args, **kwargs):  # after Ray's __cinit__ made the core worker
        signal.raise_signal(signal.SIGINT)

ray._raylet.CoreWorker = CoreWorker
from roll_core.cli import train_main

sys.argv = ["roll-train", *sys.argv[1:]]
train_main()
"""
    overrides = tiny_overrides(seven_task, tmp_path / "run", "pipeline.max_steps=1", "cluster=ray")
    proc = subprocess.run(
        [sys.executable, "-c", driver, *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "roll-train: stopped while building the pipeline (SIGINT)" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
