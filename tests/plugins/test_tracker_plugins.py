"""Tracker plugins: an out-of-tree tracker (tests/plugins/roll-dummy-engine, `roll.trackers: dummy_record`) picked
with `pipeline.trackers` receives every logged step, the samples, the truncation of a resumed run and the close,
through the same path as roll-core's `tensorboard`. Drives `Tracker` as the loop builds it; no model runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from roll_core import registry
from roll_core.config import load_config
from roll_core.tracking import Tracker

pytest.importorskip("roll_dummy_engine", reason="install tests/plugins/roll-dummy-engine (nox does)")


def _calls(run: Path) -> list[dict[str, Any]]:
    from roll_dummy_engine.tracker import FILE

    return [json.loads(line) for line in (run / FILE).read_text().splitlines()]


def test_plugin_tracker_receives_every_step_and_the_truncation_on_resume(tmp_path: Path) -> None:
    cfg = load_config(["pipeline.trackers=[tensorboard,dummy_record]", "pipeline.seed=7"])
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))  # what Pipeline gives its Tracker

    tracker = Tracker(tmp_path, config_yaml, cfg.pipeline.trackers, resume=False)
    tracker.log(0, {"eval/accuracy": 0.5})
    tracker.log(1, {"loss": 1.0, "grad_norm": float("inf"), "tokens": 12, "note": "not a number"})
    tracker.samples(1, [{"response": "4", "reward": 1.0}])
    tracker.log(2, {"loss": 0.5})
    tracker.log(3, {"loss": 0.25})
    tracker.close()
    tracker.close()

    resumed = Tracker(tmp_path, config_yaml, cfg.pipeline.trackers, resume=True)
    resumed.truncate(2)  # checkpoint at step 2: step 3 is redone
    resumed.log(3, {"loss": 0.3})
    resumed.close()

    opened = {"call": "open", "name": cfg.experiment, "resume": False, "seed": 7}
    assert _calls(tmp_path) == [
        opened,
        {"call": "log", "step": 0, "metrics": {"eval/accuracy": 0.5}},
        {"call": "log", "step": 1, "metrics": {"loss": 1.0, "tokens": 12}},  # inf and text are not sent
        {"call": "samples", "step": 1, "rows": [{"response": "4", "reward": 1.0}]},
        {"call": "log", "step": 2, "metrics": {"loss": 0.5}},
        {"call": "log", "step": 3, "metrics": {"loss": 0.25}},
        {"call": "close"},
        {**opened, "resume": True},
        {"call": "truncate", "last_step": 2},
        {"call": "log", "step": 3, "metrics": {"loss": 0.3}},
        {"call": "close"},
    ]
    assert (tmp_path / "tensorboard").is_dir()  # both backends ran side by side
    assert [h["step"] for h in Tracker.read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]


def test_backends_opened_before_a_failing_one_are_closed(tmp_path: Path) -> None:
    with pytest.raises(registry.PluginNotFoundError, match=r"no plugin 'nope' in group 'roll\.trackers'"):
        Tracker(tmp_path, trackers=["dummy_record", "nope"])
    assert [c["call"] for c in _calls(tmp_path)] == ["open", "close"]
