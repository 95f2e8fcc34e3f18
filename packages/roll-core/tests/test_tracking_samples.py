"""samples.jsonl is bounded per step: at most `tracking.samples_per_step` rows of a step (its first ones, the last
kept one counting the rows left out) and text values of at most `tracking.sample_max_chars` characters (first and
last halves kept). The file grew by whatever the collectors passed: a long run of long responses wrote gigabytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from roll_core.config import ConfigError, load_config
from roll_core.config.tracking import tracking_config
from roll_core.tracking import Tracker


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class _Recorder:
    """A sample-recording backend: what it is given must match samples.jsonl (a resume replays the file)."""

    def __init__(self) -> None:
        self.got: list[tuple[int, list[dict[str, Any]]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.got.append((step, rows))

    def truncate(self, last_step: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_steps_rows_and_texts_are_capped_as_configured(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, "tracking:\n  samples_per_step: 3\n  sample_max_chars: 10\n", trackers=())
    backend = _Recorder()
    tracker.backends.append(backend)  # type: ignore[arg-type]
    rows = [{"response": f"{i}" * 25, "turns": ["a" * 11, "short"], "task": {"q": "b" * 12}} for i in range(5)]
    tracker.samples(1, rows)
    tracker.samples(2, rows[:2])  # within the cap: nothing counted as left out
    written = _rows(tmp_path / "samples.jsonl")
    assert [r["step"] for r in written] == [1, 1, 1, 2, 2]
    assert [r.get("rows_left_out") for r in written] == [None, None, 2, None, None]
    assert written[1]["response"] == "11111[... 15 characters cut ...]11111"  # the end (an answer) stays
    assert written[0]["turns"] == ["aaaaa[... 1 characters cut ...]aaaaa", "short"]
    assert written[0]["task"] == {"q": "bbbbb[... 2 characters cut ...]bbbbb"}
    assert [(step, [{**r, "step": step} for r in got]) for step, got in backend.got] == [
        (1, written[:3]),
        (2, written[3:]),
    ]
    assert rows[0]["response"] == "0" * 25  # the caller's rows are left as they were
    with pytest.raises(ValueError, match="may not hold 'rows_left_out'"):
        tracker.samples(3, [{"rows_left_out": 1}])
    tracker.close()


def test_the_defaults_bound_a_step_of_many_long_rows(tmp_path: Path) -> None:
    """No config (a script's Tracker) gets the defaults: 16 rows of a step, texts of at most 4000 characters."""
    tracker = Tracker(tmp_path, trackers=())
    tracker.samples(1, [{"response": "x" * 100_000, "reward": 1.0}] * 40)
    written = _rows(tmp_path / "samples.jsonl")
    assert len(written) == 16 and written[-1]["rows_left_out"] == 24
    assert max(len(r["response"]) for r in written) < 4100
    assert (tmp_path / "samples.jsonl").stat().st_size < 16 * 4200  # 40 * 100 kB before
    tracker.close()


def test_zero_rows_writes_no_samples_and_zero_chars_keeps_texts_whole(tmp_path: Path) -> None:
    off = Tracker(tmp_path / "off", "tracking:\n  samples_per_step: 0\n", trackers=())
    off.samples(1, [{"response": "x"}])
    assert not (tmp_path / "off" / "samples.jsonl").exists()
    whole = Tracker(tmp_path / "whole", "tracking:\n  sample_max_chars: 0\n", trackers=())
    whole.samples(1, [{"response": "y" * 9000}])
    assert _rows(tmp_path / "whole" / "samples.jsonl")[0]["response"] == "y" * 9000
    off.close()
    whole.close()


def test_the_options_compose_and_a_misspelt_or_negative_one_is_an_error() -> None:
    cfg = load_config(["tracking.samples_per_step=4", "tracking.sample_max_chars=100"])
    assert (cfg.tracking.samples_per_step, cfg.tracking.sample_max_chars) == (4, 100)
    assert (tracking_config({}).samples_per_step, tracking_config({}).sample_max_chars) == (16, 4000)
    with pytest.raises(ConfigError, match="sample_per_step"):
        load_config(["tracking.sample_per_step=4"])
    with pytest.raises(ValueError, match=r"tracking\.samples_per_step: must be >= 0, got -1"):
        tracking_config({"tracking": {"samples_per_step": -1}})
    with pytest.raises(ValueError, match=r"tracking\.sample_max_chars: must be >= 0"):
        tracking_config({"tracking": {"sample_max_chars": -5}})
