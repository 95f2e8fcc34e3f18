"""What the run folder holds at a run's end and after a kill: the summary's last reward (the last step that logged
one, with its step), curves.png redrawn when a run fails (the steps since the last throttled plot were missing),
and config.yaml written whole or not at all (a resume reads it back)."""

from __future__ import annotations

import builtins
import io
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from roll_core import tracking
from roll_core.pipelines.loop import Pipeline
from roll_core.tracking import Tracker


def _pipeline(tracker: Any, reports: list[str]) -> Pipeline:
    """A Pipeline whose parts around the tracker are stand-ins (no cluster, no model)."""
    pipe = Pipeline.__new__(Pipeline)
    pipe.cfg = SimpleNamespace(pipeline=SimpleNamespace(eval_every=0, max_steps=5), experiment="x")
    pipe.start_step, pipe.out = 1, "run"
    pipe._created, pipe.wall_before = time.perf_counter(), 0.0
    pipe.tracker = tracker
    pipe.collector = SimpleNamespace(plot_keys=("reward/mean",), summary=dict)
    pipe.report = lambda status, wall: reports.append(status)  # type: ignore[method-assign]
    return pipe


def test_the_final_reward_is_the_last_logged_one_with_its_step() -> None:
    """The last step logged no reward (it trained nothing; its rewards all failed, logged as null): the summary read
    None although steps 1 and 2 had one."""
    history = [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.75},
        {"step": 3, "reward/mean": None, "data/empty_steps": 1.0},
        {"step": 4, "perf/step_seconds": 1.0},
    ]
    summary = _pipeline(SimpleNamespace(history=history), []).summary(1.0, None)
    assert (summary["final_reward"], summary["final_reward_step"]) == (0.75, 2)
    none = _pipeline(SimpleNamespace(history=history[:1]), []).summary(1.0, None)
    assert (none["final_reward"], none["final_reward_step"]) == (None, None)


def test_a_failed_run_redraws_its_curves_with_every_logged_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """curves.png is redrawn at most every PLOT_EVERY_S (forced only at checkpoints and the loop's end): a run that
    failed in between kept the steps since its last plot out of the curves report.md embeds."""
    drawn: list[list[int]] = []
    monkeypatch.setattr(tracking, "curve_figure", lambda history, keys: drawn.append([h["step"] for h in history]))
    tracker = Tracker(tmp_path, trackers=())
    reports: list[str] = []
    pipe = _pipeline(tracker, reports)

    def loop(stop: Any) -> bool:
        for step in (1, 2, 3):
            tracker.log(step, {"reward/mean": step / 4})
            tracker.plot(pipe._plot_keys(), force=False)  # drawn at step 1, then throttled
        raise RuntimeError("engine died")

    pipe._loop = loop  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="engine died"):
        pipe.run()
    assert drawn == [[1], [1, 2, 3]]
    assert reports == ["failed: RuntimeError: engine died"]


def test_a_plot_error_on_the_failure_path_never_hides_the_runs_exception(caplog: pytest.LogCaptureFixture) -> None:
    def plot(keys: tuple[str, ...], force: bool = True) -> None:
        raise OSError("disk full")

    reports: list[str] = []
    pipe = _pipeline(SimpleNamespace(history=[], plot=plot), reports)

    def loop(stop: Any) -> bool:
        raise ValueError("bad batch")

    pipe._loop = loop  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="bad batch"):
        pipe.run()
    assert reports == ["failed: ValueError: bad batch"]  # report.md is still written
    assert "curves.png not redrawn after the failure: OSError: disk full" in caplog.text


def test_a_config_yaml_write_cut_short_leaves_the_old_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume rewrites config.yaml; a kill or a full disk mid-write left it cut, and the next resume read the cut
    file. Written through a temporary file renamed over it, the old one stays whole."""
    Tracker(tmp_path, "experiment: demo\nalgo:\n  lr: 1.0e-05\n", []).close()
    before = (tmp_path / "config.yaml").read_text()
    real_open = builtins.open

    class Crash(OSError):
        pass

    def crashing_open(file, mode="r", *args, **kwargs):  # every write goes halfway, then the disk is full
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode:
            real_write = f.write

            def write(data: Any) -> int:
                real_write(data[: len(data) // 2])
                raise Crash("No space left on device")

            f.write = write
        return f

    monkeypatch.setattr(builtins, "open", crashing_open)
    monkeypatch.setattr(io, "open", crashing_open)  # (what Path.write_text opens with)
    with pytest.raises(Crash):
        Tracker(tmp_path, "experiment: demo\nalgo:\n  lr: 2.0e-05\n", [], resume=True)
    monkeypatch.undo()
    assert (tmp_path / "config.yaml").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # no temporary file left behind


def test_a_plot_killed_mid_save_leaves_the_earlier_curves_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """curves.png was saved in place: a kill (OOM, preemption) while savefig wrote it left a cut PNG that report.md
    embeds. Drawn to memory and renamed over the old one, the earlier picture stays whole and no temporary file is
    left."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    tracker = Tracker(tmp_path, trackers=())
    tracker.log(1, {"reward/mean": 0.5})
    assert tracker.plot() == tmp_path / "curves.png"
    before = (tmp_path / "curves.png").read_bytes()
    assert before.startswith(b"\x89PNG") and before.endswith(b"IEND\xaeB`\x82")  # a whole PNG
    real = Figure.savefig

    def killed_mid_save(self: Any, fname: Any, **kwargs: Any) -> None:
        whole = io.BytesIO()
        real(self, whole, **{**kwargs, "format": "png"})
        half = whole.getvalue()[: len(whole.getvalue()) // 2]
        if isinstance(fname, (str, Path)):
            Path(fname).write_bytes(half)
        else:
            fname.write(half)
        raise KeyboardInterrupt  # stands in for the kill: nothing after this line runs

    tracker.log(2, {"reward/mean": 0.75})
    monkeypatch.setattr(Figure, "savefig", killed_mid_save)
    with pytest.raises(KeyboardInterrupt):
        tracker.plot()
    monkeypatch.undo()
    assert (tmp_path / "curves.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]
    assert tracker.plot() == tmp_path / "curves.png"  # the next plot draws both steps, whole
    after = (tmp_path / "curves.png").read_bytes()
    assert after != before and after.endswith(b"IEND\xaeB`\x82")
    tracker.close()


class _Backend:
    """A tracker backend recording whether it was closed and the exception propagating then (how MLflow and W&B
    tell a failed run: MLflow's `close` ends it FAILED, W&B's finishes it with exit code 1)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.closed_during: list[BaseException | None] = []
        self.error = error

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def truncate(self, last_step: int) -> None:
        pass

    def close(self) -> None:
        import sys

        self.closed_during.append(sys.exc_info()[1])
        if self.error is not None:
            raise self.error


def test_a_failed_run_closes_its_trackers_with_the_failure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Only the loop's normal end closed the tracker backends: a run that raised left TensorBoard unflushed, its
    W&B and MLflow runs open (shown running, or finished, never failed) unless a caller made `shutdown`. They are
    closed on the failure path while the run's exception propagates; one backend's close error is logged, the others
    still close and the run's own exception is what is raised."""
    good, broken = _Backend(), _Backend(OSError("server away"))
    tracker = Tracker(tmp_path, trackers=())
    tracker.backends = [broken, good]
    reports: list[str] = []
    pipe = _pipeline(tracker, reports)

    def loop(stop: Any) -> bool:
        tracker.log(1, {"reward/mean": 0.5})
        raise RuntimeError("engine died")

    pipe._loop = loop  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="engine died"):
        pipe.run()
    for backend in (good, broken):
        (during,) = backend.closed_during
        assert isinstance(during, RuntimeError) and str(during) == "engine died"
    assert "closing the trackers after the failure failed: TrackerCloseError: " in caplog.text
    assert "'_Backend': OSError: server away" in caplog.text
    assert reports == ["failed: RuntimeError: engine died"]
    tracker.close()  # shutdown's close after it: nothing is closed twice
    assert len(good.closed_during) == len(broken.closed_during) == 1


class _StatusBackend:
    """A backend ending its run as W&B, MLflow and SwanLab do: failed when told so, else (`failed=None`, a caller
    that does not say) when an exception propagates."""

    def __init__(self) -> None:
        self.ends: list[bool] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def truncate(self, last_step: int) -> None:
        pass

    def close(self, failed: bool | None = None) -> None:
        import sys

        self.ends.append(sys.exc_info()[0] is not None if failed is None else failed)


def test_a_run_that_ends_well_inside_a_callers_except_block_is_not_failed(tmp_path: Path) -> None:
    """The backends read "failed" from sys.exc_info(): a run started and finished inside its caller's `except` (a
    retry loop in user code) ended FAILED in MLflow, exit code 1 in W&B, CRASHED in SwanLab. The loop says how the
    run ended; a run that fails there is still failed."""
    ends: dict[str, list[bool]] = {}
    for name, error in (("retry", None), ("retry-fails", RuntimeError("engine died again"))):
        backend = _StatusBackend()
        tracker = Tracker(tmp_path / name, trackers=())
        tracker.backends = [backend]
        pipe = _pipeline(tracker, [])

        def loop(stop: Any, error: BaseException | None = error, tracker: Tracker = tracker) -> bool:
            tracker.log(1, {"reward/mean": 0.5})
            if error is not None:
                raise error
            return True

        pipe._loop = loop  # type: ignore[method-assign]
        try:
            raise RuntimeError("engine died")  # the first attempt
        except RuntimeError:
            if error is None:
                assert pipe.run()["status"] == "finished"
            else:
                with pytest.raises(RuntimeError, match="again"):
                    pipe.run()
        tracker.close()  # shutdown's close after it: nothing is closed twice
        ends[name] = backend.ends
    assert ends == {"retry": [False], "retry-fails": [True]}


def test_close_passes_failed_to_the_backends_that_take_it(tmp_path: Path) -> None:
    """`Tracker.close(failed)` is the caller's word; without it, whether an exception propagates. A plugin whose
    `close()` takes no argument is still closed (it may read sys.exc_info itself)."""

    def close(failed: bool | None, propagating: bool) -> tuple[list[bool], list[Any]]:
        status, plain = _StatusBackend(), _Backend()
        tracker = Tracker(tmp_path, trackers=())
        tracker.backends = [status, plain]
        if not propagating:
            tracker.close(failed) if failed is not None else tracker.close()
        else:
            try:
                raise RuntimeError("propagating")
            except RuntimeError:
                tracker.close(failed) if failed is not None else tracker.close()
        return status.ends, [type(e) if e else None for e in plain.closed_during]

    assert close(None, propagating=False) == ([False], [None])
    assert close(None, propagating=True) == ([True], [RuntimeError])
    assert close(False, propagating=True) == ([False], [RuntimeError])
    assert close(True, propagating=False) == ([True], [None])


class _Plugin:
    """An out-of-tree backend built by name (`roll.trackers`) whose `close` raises `error` when set; records how
    it was closed."""

    errors: ClassVar[dict[str, BaseException | None]] = {}
    ends: ClassVar[dict[str, list[bool]]] = {}

    def __init__(self, *, run_dir: Path, config: dict[str, Any], name: str, resume: bool, plugin: str = "") -> None:
        self.plugin = plugin

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def truncate(self, last_step: int) -> None:
        pass

    def close(self, failed: bool | None = None) -> None:
        self.ends.setdefault(self.plugin, []).append(bool(failed))
        error = self.errors.get(self.plugin)
        if error is not None:
            raise error


def _plugins(monkeypatch: pytest.MonkeyPatch, errors: dict[str, BaseException | None]) -> None:
    from functools import partial

    from roll_core import registry

    _Plugin.errors, _Plugin.ends = errors, {}
    monkeypatch.setattr(registry, "load", lambda group, name: partial(_Plugin, plugin=name))


def test_plugins_whose_close_raises_at_the_runs_end_are_named_and_the_others_still_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two plugins' `close` raise at a run's normal end: the run raised the first one's bare error (naming no
    backend) and the second one's was lost. Every backend is closed once (its final flush), and one error names
    each failed backend with its error; the run's report says it once."""
    _plugins(monkeypatch, {"first": None, "broken": RuntimeError("flush refused"), "gone": OSError("server away")})
    tracker = Tracker(tmp_path, None, ["broken", "first", "gone"])
    reports: list[str] = []
    pipe = _pipeline(tracker, reports)
    pipe._loop = lambda stop: True  # type: ignore[method-assign]
    with pytest.raises(tracking.TrackerCloseError) as err:
        pipe.run()
    assert _Plugin.ends == {"broken": [False], "first": [False], "gone": [False]}  # each closed once, not failed
    message = str(err.value)
    assert "'broken': RuntimeError: flush refused" in message and "'gone': OSError: server away" in message
    assert "1 other backend(s) closed" in message and isinstance(err.value.__cause__, RuntimeError)
    assert len(reports) == 1 and reports[0].startswith("failed: TrackerCloseError: ") and "'gone'" in reports[0]
    tracker.close()  # shutdown's close after it: nothing is closed twice
    assert _Plugin.ends == {"broken": [False], "first": [False], "gone": [False]}


def test_a_plugin_whose_close_raises_while_the_trackers_start_keeps_the_start_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A later backend's constructor fails: the built ones are closed, and a close that raised there skipped the
    backends after it and replaced the error saying why the run could not start."""
    from functools import partial

    from roll_core import registry

    def load(group: str, name: str) -> Any:
        if name == "bad":
            raise ValueError("bad option")
        return partial(_Plugin, plugin=name)

    _Plugin.errors, _Plugin.ends = {"a": OSError("server away")}, {}
    monkeypatch.setattr(registry, "load", load)
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="bad option"):
        Tracker(tmp_path, None, ["a", "b", "bad"])
    assert _Plugin.ends == {"a": [True], "b": [True]}
    assert "'a': OSError: server away" in caplog.text and "while the trackers' start failed" in caplog.text


def test_an_interrupt_in_a_close_stays_an_interrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second Ctrl-C while a backend closes is still a KeyboardInterrupt (the loop turns it into its one-line
    stop), and the backends after it are still closed."""
    _plugins(monkeypatch, {"a": KeyboardInterrupt()})
    tracker = Tracker(tmp_path, None, ["a", "b"])
    with pytest.raises(KeyboardInterrupt):
        tracker.close(failed=False)
    assert _Plugin.ends == {"a": [False], "b": [False]}
