"""What `Tracker.log` takes as a metric (roll_core.tracking_values): a key that is not a string is refused before
anything is recorded, and a value that is not a number is left out with one warning per key."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from roll_core.tracking import Tracker


class _Recorder:
    """A backend that keeps what it was given."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, Any]]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.logged.append((step, dict(metrics)))

    def truncate(self, last_step: int) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("metrics", "named"),
    [
        ({1: 0.5}, "1 (int)"),  # written as "1" in metrics.jsonl, kept as 1 in memory: MLflow's worker raised
        ({("a", "b"): 0.5}, "('a', 'b') (tuple)"),  # json raised after the record was in the history
        ({"ok": 1.0, None: 2.0}, "None (NoneType)"),
        ({"ok": 1.0, True: 2.0}, "True (bool)"),
    ],
)
def test_a_metric_key_that_is_not_a_string_is_refused_before_anything_is_recorded(
    tmp_path: Path, metrics: dict[Any, float], named: str
) -> None:
    """An int key went to metrics.jsonl as text but stayed an int in the history and in what backends got (MLflow's
    worker raised TypeError at the next call); a tuple key raised out of json after the record was added to the
    history (history and file disagreed). Both are a TypeError naming the key and its type, and nothing of the
    step is recorded: not in the history, not in metrics.jsonl, not in a backend."""
    tracker = Tracker(tmp_path, trackers=())
    recorder = _Recorder()
    tracker.backends.append(recorder)  # type: ignore[arg-type]
    tracker.log(0, {"loss": 1.0})
    with pytest.raises(TypeError, match="metric keys must be strings") as err:
        tracker.log(1, metrics)  # type: ignore[arg-type]
    assert named in str(err.value)
    tracker.log(1, {"loss": 0.5})  # the tracker works on
    tracker.close()
    want = [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}]
    assert tracker.history == want
    assert Tracker.read_metrics(tmp_path / "metrics.jsonl") == want
    assert recorder.logged == [(0, {"loss": 1.0}), (1, {"loss": 0.5})]


def test_a_value_that_is_not_a_number_is_left_out_with_one_warning_per_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A text, a list, a dict, a many-element array were left out of metrics.jsonl and the backends without a word
    (a metric the user meant to chart missing with no reason given). They are still left out (not metrics), and a
    warning names each key and its value's type, once per key; None stays null (as NaN is), without a warning."""
    import numpy as np

    tracker = Tracker(tmp_path, trackers=())
    recorder = _Recorder()
    tracker.backends.append(recorder)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="roll_core.tracking"):
        for step in (1, 2, 3):
            tracker.log(
                step,
                {"loss": 0.5, "note": "text", "scores": [1, 2], "cfg": {"a": 1}, "arr": np.array([1.0, 2.0])},
            )
        tracker.log(4, {"loss": 0.25, "none": None, "note": 7})  # a key once text, now a number: logged
    tracker.close()
    assert Tracker.read_metrics(tmp_path / "metrics.jsonl") == [
        *({"step": s, "loss": 0.5} for s in (1, 2, 3)),
        {"step": 4, "loss": 0.25, "none": None, "note": 7},
    ]
    assert recorder.logged == [*((s, {"loss": 0.5}) for s in (1, 2, 3)), (4, {"loss": 0.25, "note": 7})]
    warned = [r.getMessage() for r in caplog.records if "not a number" in r.getMessage()]
    assert len(warned) == 4, warned  # once per key, not per step; none for None
    for key, kind in (("note", "str"), ("scores", "list"), ("cfg", "dict"), ("arr", "ndarray")):
        (said,) = [w for w in warned if w.startswith(f"metric {key!r}")]
        assert f"a {kind} value" in said and "left out" in said, said
