"""The stop handling of a run's last stretch: a scheduler's SIGTERM (Slurm, Kubernetes) that arrives once the last
step is done (the final curves, the trackers' close, report.md, the shutdown of a run that returned its summary) is
logged and the run ends as it would have: finished, report.md written, no kill. The handlers were restored before
that stretch, so the signal killed the process (exit 143, no report.md) after a run that had finished."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.pipelines.loop import Pipeline
from roll_core.pipelines.run_control import GracefulStop, _run_once


@pytest.fixture
def killed() -> Iterator[list[int]]:
    """SIGTERM's handler outside the run's stop handling: records the signals that would have killed the process."""
    seen: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        yield seen
    finally:
        signal.signal(signal.SIGTERM, old)


class _Tracker:
    """The tracker calls the loop makes after its steps; `close` receives a SIGTERM (an upload at close)."""

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []

    def plot(self, keys: tuple[str, ...], force: bool = True) -> None:
        pass

    def close(self) -> None:
        signal.raise_signal(signal.SIGTERM)


def _finished_pipeline(reports: list[str]) -> Pipeline:
    """A Pipeline whose steps are all done (the loop a no-op), with a tracker signalled at close."""
    pipe = Pipeline.__new__(Pipeline)
    pipe.cfg = SimpleNamespace(pipeline=SimpleNamespace(eval_every=0, max_steps=2), experiment="x")
    pipe.start_step, pipe.out = 3, "run"
    pipe._created, pipe.wall_before = time.perf_counter(), 0.0
    pipe.tracker = _Tracker()
    pipe.collector = SimpleNamespace(plot_keys=(), summary=dict)
    pipe._loop = lambda stop: None  # type: ignore[method-assign]
    pipe.report = lambda status, wall: reports.append(status)  # type: ignore[method-assign]
    return pipe


def test_a_sigterm_after_the_last_step_lets_the_run_finish(killed: list[int], caplog: pytest.LogCaptureFixture) -> None:
    reports: list[str] = []
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.run_control"):
        summary = _finished_pipeline(reports).run()
    assert killed == []  # the default handler would have ended the process here (exit 143, no report.md)
    assert summary["stopped_by_signal"] is None and reports == ["finished"]
    assert "SIGTERM received after the last step: finishing the run's wrap-up" in caplog.text


class _Finished:
    """A pipeline whose run returned its summary; its shutdown receives SIGTERM (Ray shutting down)."""

    def __init__(self, stop: GracefulStop | None = None) -> None:
        self.stop, self.closed = stop, False

    def run(self) -> dict[str, Any]:
        return {"stopped_by_signal": None}

    def shutdown(self) -> None:
        signal.raise_signal(signal.SIGTERM)
        self.closed = True


def test_a_sigterm_while_a_finished_run_shuts_down_is_not_a_kill(killed: list[int]) -> None:
    pipe = _Finished()
    assert _run_once(pipe, SimpleNamespace(), 0) == {"stopped_by_signal": None}
    assert killed == [] and pipe.closed


def test_after_a_stop_the_next_signal_in_the_shutdown_aborts(killed: list[int]) -> None:
    """The run was stopped by a first SIGTERM: a second one (in the shutdown) aborts at once, as in the steps."""
    earlier = GracefulStop()
    earlier.requested, earlier.signum = True, int(signal.SIGTERM)
    pipe = _Finished(earlier)
    with pytest.raises(KeyboardInterrupt):
        _run_once(pipe, SimpleNamespace(), 0)
    assert killed == [] and not pipe.closed


def test_once_ending_a_first_signal_is_logged_and_a_second_aborts(killed: list[int]) -> None:
    with GracefulStop() as stop:
        stop.ending()
        signal.raise_signal(signal.SIGTERM)
        assert (stop.requested, stop.signum, stop.late_signum) == (False, None, signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    assert killed == []
