"""The stop handling outside the steps. A scheduler's SIGTERM (Slurm, Kubernetes) that arrives once the last step is
done (the final curves, the trackers' close, report.md, the shutdown of a run that returned its summary) is logged
and the run ends as it would have: finished, report.md written, no kill. The handlers were restored before that
stretch, so the signal killed the process (exit 143, no report.md) after a run that had finished. A signal while
the pipeline is built stops the build and shuts down what it started (it had Python's default meaning)."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.pipelines import run_control
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

    def close(self, failed: bool | None = None) -> None:
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
    assert summary["stopped_by_signal"] is None and summary["late_signal"] == signal.SIGTERM
    assert reports == ["finished: every step trained; SIGTERM received at the end skipped nothing"]
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


def test_a_signal_while_the_pipeline_is_built_stops_it_and_shuts_down_what_it_started(
    killed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build's first SIGTERM raises StoppedWhileBuilding where the build is; the cluster is shut down and the run
    folder's lock released (the signal killed the process outright: no shutdown, no word). The handlers are the
    caller's again afterwards."""
    closed: list[str] = []

    def build(self: Pipeline, cfg: Any, output_dir: Any) -> None:
        self.run_lock = SimpleNamespace(release=lambda: closed.append("lock"))
        self.cluster = SimpleNamespace(shutdown=lambda: closed.append("cluster"))
        signal.raise_signal(signal.SIGTERM)  # a model loading, an engine starting
        closed.append("built on")

    monkeypatch.setattr(Pipeline, "_build", build)
    with pytest.raises(KeyboardInterrupt) as info:
        Pipeline(SimpleNamespace())  # type: ignore[arg-type]
    assert isinstance(info.value, run_control.StoppedWhileBuilding) and info.value.signum == signal.SIGTERM
    assert "stopped while building the pipeline (SIGTERM)" in str(info.value)
    assert closed == ["cluster", "lock"] and killed == []
    signal.raise_signal(signal.SIGTERM)
    assert killed == [signal.SIGTERM]  # the handler in place before the build


def test_build_stop_outlasts_a_replaced_handler_and_a_second_signal_aborts_the_cleanup(killed: list[int]) -> None:
    """`ray.init` installs Ray's SIGTERM handler (an abort with a stack dump, exit 134) in the middle of the build:
    `rearm()` takes it back. A second signal, while the first one's cleanup runs, aborts it."""
    with run_control.BuildStop() as building:
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as ray.init does
        building.rearm()
        with pytest.raises(run_control.StoppedWhileBuilding):
            signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt) as second:
            signal.raise_signal(signal.SIGINT)
        assert not isinstance(second.value, run_control.StoppedWhileBuilding)
    signal.raise_signal(signal.SIGTERM)
    assert killed == [signal.SIGTERM]  # the fixture's handler restored, not the replacement
