"""SwanLab tracking in local mode (no network, no login): what a run writes is read back from SwanLab's own files.

The reader is SwanLab's own: the backup file of each experiment (`<run>/swanlog/run-*/backup.swanlab`, the file
`swanlab sync` uploads) parsed by `swanlab.log.backup` (DataStore + ModelsParser), wrapped by
`roll_core.trackers.swanlab.read_local_run`; the config is SwanLab's `files/config.yaml`. The local dashboard's
database (`runs.swanlab`, what `swanlab watch` serves) is checked to list the experiment. Covered: the conformance
suite (roll_core.testing.trackers), a tiny run with `pipeline.trackers=[swanlab]` (every metric of metrics.jsonl at
its step, the resolved config, the samples), `mode=auto` choosing local without credentials, and the one-line error
without the package.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from roll_core.testing.trackers import TrackerTestSuite, assert_steps
from roll_core.tracking import Tracker


def _current(run_dir: Path) -> dict[str, Any]:
    """The experiment the run folder records (a resumed run has one per attempt), read with SwanLab's reader."""
    from roll_core.trackers.swanlab import STATE_FILE, read_local_run

    state = json.loads((run_dir / "swanlog" / STATE_FILE).read_text())
    return read_local_run(state["run_dir"])


@pytest.fixture(autouse=True)
def _no_account(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials reach these tests, so `mode=auto` must choose local; SwanLab's own settings stay in tmp."""
    for var in ("SWANLAB_API_KEY", "SWANLAB_MODE", "SWANLAB_LOG_DIR", "SWANLAB_PROJ_NAME", "SWANLAB_EXP_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-home"))  # where a `swanlab login` would be


class TestSwanlabConformance(TrackerTestSuite):
    tracker = "swanlab"
    run_config: ClassVar[dict[str, Any]] = {
        "tracking": {"swanlab": {"project": "conformance", "hardware_monitor": False}}
    }

    def read_back(self, run_dir: Path) -> dict[int, dict[str, float]]:
        return _current(run_dir)["history"]

    def read_samples(self, run_dir: Path) -> dict[int, list[dict[str, Any]]]:
        return _current(run_dir)["samples"]

    def read_config(self, run_dir: Path) -> dict[str, Any]:
        return _current(run_dir)["config"]


def test_tiny_run_in_local_mode(tmp_path: Path) -> None:
    pytest.importorskip("swanlab", reason="the roll-core[swanlab] extra")
    from roll_core.testing import constant_answer_task, run_pipeline, tiny_overrides
    from roll_core.trackers.swanlab import resolve_mode

    assert resolve_mode("auto") == "local"  # no API key here: SwanLab never asks for a login
    out = tmp_path / "run"
    overrides = ["pipeline.max_steps=2", "pipeline.trackers=[swanlab]", "tracking.swanlab.tags=[tiny]"]
    overrides += ["tracking.swanlab.hardware_monitor=false", "tracking.group=g1"]
    # A smaller tiny run than tiny_overrides' (what is tested is the tracking, not the learning).
    overrides += ["algo.group_size=2", "pipeline.rollout_batch_size=2", "env.eval_size=2", "pipeline.eval_size=2"]
    _, history = run_pipeline(tiny_overrides(constant_answer_task(tmp_path / "seven.jsonl"), out, *overrides))

    run = _current(out)
    assert (run["project"], run["name"], run["tags"], run["success"]) == ("roll", "rlvr", ["tiny", "g1"], True)
    assert run["config"] == yaml.safe_load((out / "config.yaml").read_text())  # the resolved config, all of it
    assert [h["step"] for h in history][-2:] == [1, 2]
    assert_steps(run["history"], {h["step"]: {k: v for k, v in h.items() if k != "step"} for h in history})
    samples: dict[int, list[dict[str, Any]]] = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        samples.setdefault(row.pop("step"), []).append(row)
    assert samples and run["samples"] == samples  # row for row, at their steps
    # The local dashboard (`swanlab watch <run>/swanlog`) lists the experiment and its charts.
    with sqlite3.connect(out / "swanlog" / "runs.swanlab") as db:
        assert db.execute("select name from experiment").fetchall() == [("rlvr",)]
        tags = {name for (name,) in db.execute("select name from tag")}
    assert {"reward/mean", "samples"} <= tags
    assert not list(out.glob("swanlog/run-*/console/*.log"))  # the console stays roll's


def test_without_swanlab_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_core.errors import MissingExtraError

    for name in [m for m in sys.modules if m == "swanlab" or m.startswith("swanlab.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "swanlab", None)
    with pytest.raises(MissingExtraError) as err:
        Tracker(tmp_path, "experiment: demo\n", ["swanlab"])
    assert str(err.value) == "pipeline.trackers=[swanlab] needs swanlab: pip install 'roll-core[swanlab]'"


def test_a_resume_while_the_cloud_is_away_goes_on_and_sends_its_steps_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A resumed run whose SwanLab cloud did not answer ended at once: `swanlab.init` raised requests'
    ConnectionError out of `truncate`. It goes on with a warning; once SwanLab answers (here at close's last try)
    the new experiment gets every step from metrics.jsonl."""
    import logging
    import socket

    pytest.importorskip("swanlab", reason="the roll-core[swanlab] extra")
    options = {"project": "away", "hardware_monitor": False}
    first = Tracker(tmp_path, yaml.safe_dump({"experiment": "away", "tracking": {"swanlab": options}}), ["swanlab"])
    for step in range(3):
        first.log(step, {"loss": float(step)})
    first.close()
    with socket.socket() as s:  # a port nothing listens on: SwanLab's cloud is away
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("SWANLAB_API_KEY", "k" * 21)
    monkeypatch.setenv("SWANLAB_API_HOST", f"http://127.0.0.1:{port}/api")
    monkeypatch.setenv("SWANLAB_WEB_HOST", f"http://127.0.0.1:{port}")
    cloud = yaml.safe_dump({"experiment": "away", "tracking": {"swanlab": {**options, "mode": "cloud"}}})
    resumed = Tracker(tmp_path, cloud, ["swanlab"], resume=True)
    with caplog.at_level(logging.WARNING, logger="roll_core.trackers.swanlab"):
        resumed.truncate(2)  # no exception: training goes on
        resumed.log(3, {"loss": 30.0})
        resumed.samples(3, [{"prompt": "p", "response": "r", "reward": 1.0}])
    (warning,) = [r for r in caplog.records if r.name == "roll_core.trackers.swanlab"]
    assert warning.levelno == logging.WARNING and "goes on without it" in warning.getMessage()
    resumed.backends[0].mode = "local"  # SwanLab answers again (local files: what this test can read back)
    resumed.close()  # one more try: a new experiment replays steps 0-3 from the run folder
    run = _current(tmp_path)
    assert {s: m["loss"] for s, m in run["history"].items()} == {0: 0.0, 1: 1.0, 2: 2.0, 3: 30.0}
    assert run["samples"] == {3: [{"prompt": "p", "response": "r", "reward": 1.0}]}
    assert "resumed" in run["tags"]


def test_a_failed_run_is_a_crashed_swanlab_experiment(tmp_path: Path) -> None:
    """`run.finish()` had no state: SwanLab showed a failed run as successful. Closed while the run's exception
    propagates (or told `failed=True`), the experiment is CRASHED: its backup file (what `swanlab sync` uploads) says
    not successful and the local dashboard lists it with status -1, with the error (credentials redacted). A run told
    `failed=False` inside its caller's `except` (a retry that ended well) stays successful."""
    pytest.importorskip("swanlab", reason="the roll-core[swanlab] extra")
    options = {"project": "ends", "hardware_monitor": False}
    cfg = yaml.safe_dump({"experiment": "ends", "tracking": {"swanlab": options}})

    def end(name: str, how: str) -> tuple[bool, int]:
        tracker = Tracker(tmp_path / name, cfg, ["swanlab"])
        tracker.log(1, {"loss": 1.0})
        if how == "ok":
            tracker.close()
        elif how == "told":
            tracker.close(failed=True)
        else:
            try:
                raise RuntimeError("engine died at https://user:secret@host/x")
            except RuntimeError:
                tracker.close() if how == "propagating" else tracker.close(failed=False)
        with sqlite3.connect(tmp_path / name / "swanlog" / "runs.swanlab") as db:
            ((status,),) = db.execute("select status from experiment").fetchall()
        run = _current(tmp_path / name)
        assert run["history"] == {1: {"loss": 1.0}}
        return run["success"], status

    ends = {how: end(how, how) for how in ("ok", "told", "propagating", "retry-ok")}
    assert ends == {"ok": (True, 1), "told": (False, -1), "propagating": (False, -1), "retry-ok": (True, 1)}
    errors = (tmp_path / "propagating" / "swanlog").glob("run-*/console/error.log")  # SwanLab's file of the error
    assert [p.read_text().splitlines()[-1] for p in errors] == ["RuntimeError: engine died at https://***@host/x"]


def test_metric_names_swanlab_refuses_are_renamed_not_raised(tmp_path: Path) -> None:
    """SwanLab refuses a blank name and one starting or ending with `.` or `/` (ValueError into the training loop:
    the step lost, the run ended, the metrics logged before it in that step kept). Each is logged under a name it
    takes, distinct from every other key's and from the `samples` column; metrics.jsonl keeps the keys as given."""
    cfg = yaml.safe_dump({"experiment": "names", "tracking": {"swanlab": {"hardware_monitor": False}}})
    metrics = {"big": 1.0, "": 2.0, "/lead": 3.0, "_lead": 4.0, "eval/": 5.0, " pad ": 6.0, "samples": 7.0}
    tracker = Tracker(tmp_path, cfg, ["swanlab"])
    tracker.log(1, metrics)
    tracker.log(2, {"/lead": 8.0})
    tracker.close()
    shown = _current(tmp_path)["history"]
    assert shown[1]["big"] == 1.0 and shown[1]["_"] == 2.0 and shown[1]["eval_"] == 5.0 and shown[1]["pad"] == 6.0
    assert shown[1]["_lead"] == 4.0  # a name SwanLab takes as it is keeps it; `/lead` gets a suffix beside it
    (lead,) = [k for k, v in shown[1].items() if v == 3.0]
    (samples,) = [k for k, v in shown[1].items() if v == 7.0]
    assert lead.startswith("_lead-") and samples.startswith("samples-") and shown[2] == {lead: 8.0}
    assert len(shown[1]) == len(metrics)  # none lost, none merged
    assert Tracker.read_metrics(tmp_path / "metrics.jsonl")[0] == {"step": 1, **metrics}
    from roll_core.trackers.swanlab import swanlab_key

    assert [swanlab_key(k) for k in ("a" * 300, "x" * 254 + "/y", "./a/.")] == ["a" * 255, "x" * 254 + "_", "_/a/_"]
