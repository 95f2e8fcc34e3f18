"""Fixtures shared by roll-core's tests."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def roll_train(monkeypatch: pytest.MonkeyPatch) -> Callable[..., int]:
    """`roll_train(*args, job=None)`: roll-train `args` (roll_core.cli.train_main, in this process) with each job's run
    (roll_core.cli.run_job) replaced by `job(cfg) -> result`; `job=None`: a run that must not be reached (an
    AssertionError, as `--cfg job` must print and stop). Returns roll-train's exit status (0 where it returns)."""
    from roll_core import cli

    def no_run(cfg: Any) -> dict[str, Any]:
        raise AssertionError("--cfg must not run the job")

    def train(*args: str, job: Callable[[Any], dict[str, Any]] | None = None) -> int:
        monkeypatch.setattr(cli, "run_job", job or no_run)
        monkeypatch.setattr(sys, "argv", ["roll-train", *args])
        try:
            cli.train_main()
        except SystemExit as exit_:
            return int(exit_.code or 0)
        return 0

    return train


@pytest.fixture
def lr_scored_job() -> Callable[[list[float]], Callable[[Any], dict[str, Any]]]:
    """`lr_scored_job(ran)`: a job run for `roll_train(job=...)` that appends its `algo.lr` to `ran` and returns the
    final held-out accuracy lr * 1e5 (in [0.1, 1] for an lr in [1e-6, 1e-5]), no stop signal."""

    def scored(ran: list[float]) -> Callable[[Any], dict[str, Any]]:
        def run(cfg: Any) -> dict[str, Any]:
            ran.append(cfg.algo.lr)
            return {"final_eval_accuracy": cfg.algo.lr * 1e5, "stopped_by_signal": None}

        return run

    return scored


#: A stop Python drops (the code of `stop_child`'s children): `drop_a_stop(after)` raises SIGINT inside a weakref
#: callback, where the handler's exception is only "ignored" by Python (roll's hook keeps it), and runs `after` inside
#: the callback (a library installing its own handler there).
DROP_A_STOP = """
import signal, weakref

class O:
    pass

def drop_a_stop(after=lambda: None):
    o = O()

    def cb(_):
        try:
            signal.raise_signal(signal.SIGINT)  # the handler raises the stop here, where Python drops it
        finally:
            after()

    r = weakref.ref(o, cb)
    del o
"""


@pytest.fixture
def stop_child() -> Callable[[str, str], str]:
    """`stop_child(prelude, body)`: the stdout of a child Python running `prelude`, DROP_A_STOP, then `body`
    (dedented); asserts it exits 0 with no traceback and no "Exception ignored". Stops are dropped only inside a
    weakref callback, and the thread that delivers one again signals its own process: hence a child."""
    import subprocess
    import textwrap

    def run(prelude: str, body: str) -> str:
        code = prelude + DROP_A_STOP + textwrap.dedent(body)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
        assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return proc.stdout

    return run


@pytest.fixture
def fresh_sweep_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No sweep, failed job or stop signal of earlier tests (roll_core.sweep keeps them per process), and the root
    logger put back after the test (Hydra's job logging adds handlers): for tests that run sweeps in this process."""
    from roll_core.testing.sweeps import reset_sweep_state, root_logging_restored

    reset_sweep_state(monkeypatch)
    with root_logging_restored():
        yield
