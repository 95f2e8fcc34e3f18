"""What the training loop says on the console (roll_core.pipelines._console): a tqdm bar on a terminal, one plain
log line per step elsewhere (a log file under nohup, Slurm or a Ray job got every bar update on one line separated
by carriage returns, and `pipeline.progress=false` said nothing per step); the first step shows the evaluation
before step 1; the run ends with one line worded by how it ended (it logged `run finished: {dict}`, then roll-train
printed the same summary as JSON, and a run stopped by a signal said "run finished" too)."""

from __future__ import annotations

import io
import logging
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.pipelines import _console
from roll_core.pipelines.loop import Pipeline
from roll_core.tracking import Tracker

LOOP = "roll_core.pipelines.loop"
CONSOLE = "roll_core.pipelines._console"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _pipeline(tmp_path: Path, *, progress: bool, stop_in: int | None = None) -> Pipeline:
    """A Pipeline of stand-ins around the loop (no cluster, no model): steps 1..3 with rewards 0.1 * step, held-out
    accuracy 0.25 before step 1, then at steps 2 and 3 (eval_every=2; the last step evaluates); a SIGTERM handled
    in step `stop_in`."""
    pipe = Pipeline.__new__(Pipeline)
    pipe.cfg = SimpleNamespace(
        pipeline=SimpleNamespace(
            eval_every=2, max_steps=3, save_every=0, progress=progress, max_loss_scale_skips=0, max_nonfinite_steps=0
        ),
        experiment="x",
    )
    pipe.start_step, pipe.out = 1, tmp_path
    pipe._created, pipe.wall_before = time.perf_counter(), 0.0
    pipe.tracker = Tracker(tmp_path, trackers=())
    pipe.tracker.plot = lambda keys, force=True: None  # type: ignore[method-assign]
    evals = {0: 0.25, 2: 0.5, 3: 0.75}
    pipe.collector = SimpleNamespace(plot_keys=(), summary=dict, evaluate=lambda step: {"eval/accuracy": evals[step]})
    pipe.trainer = SimpleNamespace(scaler_streak=0, bad_steps=0, stale=False)
    pipe.empty_steps = SimpleNamespace(exceeded=False)
    pipe.checkpoint = lambda step: None  # type: ignore[method-assign]
    pipe.healthy_checkpoint = None
    pipe.report = lambda status, wall: None  # type: ignore[method-assign]

    def step(n: int) -> dict[str, Any]:
        if n == stop_in:
            pipe.stop._handle(signal.SIGTERM, None)
        return {"reward/mean": 0.1 * n, "reward/accuracy": 0.125 * n, "perf/step_seconds": 2.94}

    pipe.step = step  # type: ignore[method-assign]
    return pipe


def _messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


@pytest.mark.parametrize("progress", [True, False])
def test_off_a_terminal_each_step_is_one_plain_line_starting_with_the_step_0_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, progress: bool
) -> None:
    """stderr not a terminal (progress on or off): no bar, a line per step with the bar's fields; step 1's line
    carries the held-out accuracy of the evaluation before it (it showed none until step 2's evaluation)."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with caplog.at_level(logging.INFO):
        summary = _pipeline(tmp_path, progress=progress).run()
    assert _messages(caplog, CONSOLE) == [
        "step 1/3 reward=0.100 acc=0.12 eval_acc=0.25 sec=2.9",
        "step 2/3 reward=0.200 acc=0.25 eval_acc=0.50 sec=2.9",
        "step 3/3 reward=0.300 acc=0.38 eval_acc=0.75 sec=2.9",
    ]
    assert "\r" not in err.getvalue() and "step/s" not in err.getvalue()  # no bar anywhere
    assert summary["status"] == "finished" and summary["final_eval_accuracy"] == 0.75


def test_on_a_terminal_the_bar_stays_and_shows_the_step_0_evaluation_from_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tqdm.std import tqdm

    monkeypatch.setattr(tqdm, "monitor_interval", 0)  # no monitor thread left behind
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with caplog.at_level(logging.INFO):
        _pipeline(tmp_path, progress=True).run()
    assert _messages(caplog, CONSOLE) == []  # the bar, not lines
    drawn = term.getvalue().split("\r")
    first = next(d for d in drawn if "0/3" in d)
    assert "eval_acc=0.25" in first  # before step 1 is done
    assert "3/3" in drawn[-1] and "eval_acc=0.75" in drawn[-1]


def test_the_choice_of_bar_or_lines() -> None:
    assert _console.use_bar(True, _Terminal())
    assert not _console.use_bar(True, io.StringIO())  # a log file, a pipe
    assert not _console.use_bar(False, _Terminal())  # progress off: lines, not silence (StepReport)
    closed = io.StringIO()
    closed.close()
    assert not _console.use_bar(True, closed)
    assert _console.step_line(3, 10, {"reward": "0.410", "eval_acc": "0.50", "sec": "2.9"}) == (
        "step 3/10 reward=0.410 eval_acc=0.50 sec=2.9"
    )


def test_the_first_steps_fields_are_seeded_from_the_latest_evaluation() -> None:
    """The step-0 evaluation (or a resumed run's last one) is what `previous` holds for step 1."""
    assert _console.seed_fields([{"step": 0, "eval/accuracy": 0.5}]) == {"eval_acc": "0.50"}
    resumed = [{"step": 0, "eval/accuracy": 0.25}, {"step": 4, "eval/accuracy": 0.625}, {"step": 5, "reward/mean": 1}]
    assert _console.seed_fields(resumed) == {"eval_acc": "0.62"}
    assert _console.seed_fields([{"step": 1, "reward/mean": 0.0, "eval/accuracy": None}]) == {}
    first = _console.progress_fields({"reward/mean": 0.5}, _console.seed_fields(resumed))
    assert first == {"reward": "0.500", "eval_acc": "0.62"}


def test_the_run_ends_with_one_line_that_says_how_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A finished run: `run finished` with its headline numbers, once (no dict repr: roll-train prints the summary
    as JSON). A run stopped by SIGTERM in step 2: a warning `run stopped by signal 15 (...)`, never "finished"."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO):
        _pipeline(tmp_path / "a", progress=False).run()
    ends = [r for r in caplog.records if r.name == LOOP and r.getMessage().startswith("run ")]
    assert len(ends) == 1 and ends[0].levelno == logging.INFO
    assert re.fullmatch(
        r"run finished \| final eval_acc=0\.75, best=0\.75, reward=0\.3 \(step 3\), wall \d+\.\ds, in .*/a",
        ends[0].getMessage(),
    )
    assert not any("{" in r.getMessage() for r in caplog.records if r.name == LOOP)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        summary = _pipeline(tmp_path / "b", progress=False, stop_in=2).run()
    assert summary["stopped_by_signal"] == signal.SIGTERM
    ends = [r for r in caplog.records if r.name == LOOP and r.getMessage().startswith("run ")]
    assert len(ends) == 1 and ends[0].levelno == logging.WARNING
    assert ends[0].getMessage().startswith("run stopped by signal 15 (no checkpoint to resume from) | ")
    assert not any("finished" in r.getMessage() for r in caplog.records if r.name == LOOP)
