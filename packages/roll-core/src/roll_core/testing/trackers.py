"""Conformance suite of the tracker contract (`roll_core.interfaces.tracking.TrackerBackend`): every backend passes it.

The suite drives a backend the way a run does, through `roll_core.tracking.Tracker` with `trackers=[<name>]`, and
then asks the test what the backend recorded, read back from its own files or service (never from the Tracker's
metrics.jsonl, unless that is the backend's record, as for `jsonl`). Checks:
- the registered class is a `TrackerBackend` with an `extra` attribute (the `roll_core.errors.Extra` it needs, or
  None: roll-doctor reads it);
- every logged step holds exactly its finite metrics (a NaN is left out, ints and floats kept); `close()` twice
  is fine; samples (where the backend records them) come back per step, row for row; the run's config reaches
  the backend (where it records one);
- resume: a run that redoes steps after its checkpoint (`truncate(last_step)`) shows the redone values and
  nothing of the abandoned steps; a run resumed at its last logged step continues with nothing lost.

Usage (roll-core's backends in packages/roll-core/tests/test_tracking_backends.py)::

    from roll_core.testing.trackers import TrackerTestSuite

    class TestMyTracker(TrackerTestSuite):
        tracker = "my_tracker"                  # its `roll.trackers` name
        run_config = {"tracking": {"plugins": {"my_tracker": {"offline": True}}}}

        def read_back(self, run_dir):           # {step: {metric: value}} as the backend's store shows the run
            ...

        def read_samples(self, run_dir):        # optional: {step: [row, ...]}; None: samples are not recorded
            ...

        def read_config(self, run_dir):         # optional: the config the backend recorded; None: none
            ...

`build` may raise `roll_core.testing.CannotRunHere` (or ImportError) when the backend cannot run here (its package
or server is missing): the suite skips with the message. Each test opens the backend two or three times: keep its
start-up short (offline or local modes).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import pytest

from roll_core.interfaces.tracking import TrackerBackend
from roll_core.testing import CannotRunHere

__all__ = ["FIRST_ATTEMPT", "TrackerTestSuite", "assert_steps"]

#: What the first attempt of a run logs: step 0 (the evaluation before training) and three training steps.
FIRST_ATTEMPT: dict[int, dict[str, Any]] = {
    0: {"eval/accuracy": 0.25},
    1: {"loss": 1.5, "reward/mean": 0.5, "tokens": 12, "grad_norm": float("nan")},
    2: {"loss": 1.25, "reward/mean": 0.75, "tokens": 14},
    3: {"loss": 1.0, "reward/mean": 1.0, "tokens": 16},
}
#: Samples the first attempt logs (a unicode and a structured value included).
SAMPLES: dict[int, list[dict[str, Any]]] = {
    1: [
        {"prompt": "Q1: say 7", "response": "7", "reward": 1.0},
        {"prompt": "Q2: say 7", "response": "sept \u2192 7 \U0001f642", "reward": 0.0},
    ],
    3: [{"prompt": "Q3: say 7", "response": "", "reward": 0.0}],
}


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def assert_steps(shown: dict[int, dict[str, float]], expected: dict[int, dict[str, Any]]) -> None:
    """Assert that `shown` holds exactly the finite metrics of `expected`, step by step (values approximately)."""
    want = {step: _finite(m) for step, m in expected.items()}
    assert sorted(shown) == sorted(want), f"steps recorded: {sorted(shown)}, logged: {sorted(want)}"
    for step, metrics in want.items():
        assert set(shown[step]) == set(metrics), f"step {step}: recorded {sorted(shown[step])}, sent {sorted(metrics)}"
        assert shown[step] == pytest.approx(metrics), f"step {step}"


class TrackerTestSuite:
    """Subclass with `tracker` and `read_back` (and `read_samples`/`read_config` where the backend records them)."""

    #: The backend's `roll.trackers` entry-point name.
    tracker: ClassVar[str] = ""
    #: Config given to the run besides `experiment` (e.g. the backend's `tracking.<name>` options).
    run_config: ClassVar[dict[str, Any]] = {}

    def read_back(self, run_dir: Path) -> dict[int, dict[str, float]]:
        """{step: {metric: value}} of the run in `run_dir` as the backend's store shows it (after close)."""
        raise NotImplementedError

    def read_samples(self, run_dir: Path) -> dict[int, list[dict[str, Any]]] | None:
        """{step: rows} as recorded by the backend; None when the backend does not record samples."""
        return None

    def read_config(self, run_dir: Path) -> dict[str, Any] | None:
        """The run config the backend recorded (plain containers); None when it records none."""
        return None

    def config_yaml(self) -> str:
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.create({"experiment": "conformance", **self.run_config}))

    def build(self, run_dir: Path, resume: bool = False) -> Any:
        """A `Tracker` over `run_dir` writing to this backend only, as a run builds it."""
        from roll_core.tracking import Tracker

        try:
            return Tracker(run_dir, self.config_yaml(), [self.tracker], resume=resume)
        except CannotRunHere as exc:
            pytest.skip(str(exc))
        except ImportError as exc:
            pytest.skip(f"{self.tracker}: {exc}")

    def _first_attempt(self, run_dir: Path, steps: range) -> None:
        tracker = self.build(run_dir)
        for step in steps:
            tracker.log(step, {**FIRST_ATTEMPT[step], "note": "text is not a metric"})
            if step in SAMPLES:
                tracker.samples(step, SAMPLES[step])
        tracker.close()
        tracker.close()  # idempotent: a failed run's cleanup closes again

    def test_is_a_tracker_backend(self, tmp_path: Path) -> None:
        from roll_core import registry

        cls = registry.load("roll.trackers", self.tracker)
        assert hasattr(cls, "extra"), f"{cls.__name__} has no `extra` attribute (its Extra, or None)"
        tracker = self.build(tmp_path)
        try:
            assert len(tracker.backends) == 1 and isinstance(tracker.backends[0], TrackerBackend)
        finally:
            tracker.close()

    def test_logs_every_step_samples_and_config(self, tmp_path: Path) -> None:
        self._first_attempt(tmp_path, range(4))
        assert_steps(self.read_back(tmp_path), FIRST_ATTEMPT)
        samples = self.read_samples(tmp_path)
        if samples is not None:
            assert samples == SAMPLES
        config = self.read_config(tmp_path)
        if config is not None:
            assert config.get("experiment") == "conformance", config
            for key, value in self.run_config.items():
                assert config.get(key) == value, f"config {key}: {config.get(key)!r}"

    def test_resume_redoes_the_steps_after_the_checkpoint(self, tmp_path: Path) -> None:
        self._first_attempt(tmp_path, range(4))
        resumed = self.build(tmp_path, resume=True)
        resumed.truncate(1)  # the checkpoint was at step 1: steps 2 and 3 are redone, with other values
        redone = {2: {"loss": 9.0, "reward/mean": 0.0}, 3: {"loss": 8.0, "kl": 0.5}}
        resumed.log(2, redone[2])
        resumed.samples(2, [{"prompt": "Q9", "response": "9", "reward": 0.0}])
        resumed.log(3, redone[3])
        resumed.close()
        assert_steps(self.read_back(tmp_path), {0: FIRST_ATTEMPT[0], 1: FIRST_ATTEMPT[1], **redone})
        samples = self.read_samples(tmp_path)
        if samples is not None:
            assert samples == {1: SAMPLES[1], 2: [{"prompt": "Q9", "response": "9", "reward": 0.0}]}

    def test_resume_at_the_last_step_continues(self, tmp_path: Path) -> None:
        self._first_attempt(tmp_path, range(3))
        resumed = self.build(tmp_path, resume=True)
        resumed.truncate(2)  # checkpoint at the last logged step (a preemption): nothing is redone
        resumed.log(3, FIRST_ATTEMPT[3])
        resumed.close()
        resumed.close()
        assert_steps(self.read_back(tmp_path), FIRST_ATTEMPT)
