"""Tracker: metrics.jsonl is the core, every other sink is a `roll.trackers` backend named in `pipeline.trackers`.

Drives `Tracker` directly (no model, no pipeline): the built-in TensorBoard backend logs finite metrics and purges
the steps a resumed run redoes; `pipeline.trackers=[]` writes no TensorBoard folder; a tracker name that is not
installed is a config error listing the installed ones; without TensorBoard in `pipeline.trackers` the run needs no
`roll-core[track]`. The conformance suite (roll_core.testing.trackers) runs for `tensorboard` and `jsonl`; `jsonl`
writes nothing besides the core files. W&B: test_tracking_wandb.py. The out-of-tree side (a plugin receiving every
call) is tests/plugins/test_tracker_plugins.py.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from roll_core import registry
from roll_core.config import ConfigError, load_config
from roll_core.testing.trackers import TrackerTestSuite
from roll_core.tracking import Tracker


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: (step, value) per tag, after its own purge of events a restarted writer redid."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class TestTensorBoardConformance(TrackerTestSuite):
    tracker = "tensorboard"

    def read_back(self, run_dir: Path) -> dict[int, dict[str, float]]:
        pytest.importorskip("tensorboard", reason="the roll-core[track] extra")
        shown: dict[int, dict[str, float]] = {}
        for tag, points in _scalars(run_dir / "tensorboard").items():
            for step, value in points:
                shown.setdefault(step, {})[tag] = value
        return shown


class TestJsonlConformance(TrackerTestSuite):
    tracker = "jsonl"

    def read_back(self, run_dir: Path) -> dict[int, dict[str, float]]:
        """The backend's record is the core's metrics.jsonl (nulls are the NaNs no backend receives)."""
        records = Tracker.read_metrics(run_dir / "metrics.jsonl")
        return {r["step"]: {k: v for k, v in r.items() if k != "step" and v is not None} for r in records}

    def read_samples(self, run_dir: Path) -> dict[int, list[dict[str, Any]]]:
        rows: dict[int, list[dict[str, Any]]] = {}
        for line in (run_dir / "samples.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row.pop("step"), []).append(row)
        return rows

    def test_writes_only_the_core_files(self, tmp_path: Path) -> None:
        tracker = Tracker(tmp_path, "experiment: demo\n", ["jsonl"])
        tracker.log(1, {"loss": 1.0})
        tracker.samples(1, [{"response": "7"}])
        tracker.close()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "metrics.jsonl", "samples.jsonl"]


def test_tensorboard_backend_logs_finite_metrics_and_purges_the_redone_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("tensorboard", reason="the roll-core[track] extra")
    tracker = Tracker(tmp_path, "experiment: demo\n")  # the default: pipeline.trackers=[tensorboard]
    for step in range(4):
        tracker.log(step, {"loss": step / 2, "grad_norm": float("nan") if step == 1 else 1.0, "note": "text"})
    tracker.close()
    tracker.close()  # idempotent: a failed run's cleanup closes again
    assert _scalars(tmp_path / "tensorboard") == {
        "loss": [(0, 0.0), (1, 0.5), (2, 1.0), (3, 1.5)],
        "grad_norm": [(0, 1.0), (2, 1.0), (3, 1.0)],  # NaN is skipped here, null in metrics.jsonl
    }

    resumed = Tracker(tmp_path, "experiment: demo\n", resume=True)
    resumed.truncate(1)  # the checkpoint was at step 1: steps 2 and 3 are redone, with other values
    resumed.log(2, {"loss": 9.0, "grad_norm": 2.0})
    resumed.close()
    with caplog.at_level(logging.WARNING):  # TensorBoard logs its purge of the stale events
        shown = _scalars(tmp_path / "tensorboard")
    assert shown == {"loss": [(0, 0.0), (1, 0.5), (2, 9.0)], "grad_norm": [(0, 1.0), (2, 2.0)]}
    assert Tracker.read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 0, "loss": 0.0, "grad_norm": 1.0},
        {"step": 1, "loss": 0.5, "grad_norm": None},
        {"step": 2, "loss": 9.0, "grad_norm": 2.0},
    ]


def test_a_resume_after_an_attempt_without_tensorboard_replays_the_steps_it_missed(tmp_path: Path) -> None:
    """Steps 0-2 with tensorboard, 3-5 without it (trackers=[]), then tensorboard again from a checkpoint at step 4:
    the event files hold 0-4 from the records and 5-6 from the last attempt (they lacked 3-5, step 5 is redone)."""
    pytest.importorskip("tensorboard", reason="the roll-core[track] extra")
    for trackers, steps, checkpoint in (
        (["tensorboard"], range(3), None),
        ([], range(3, 6), 2),
        (None, range(5, 7), 4),
    ):
        tracker = Tracker(
            tmp_path, "experiment: gap\n", *([trackers] if trackers is not None else []), resume=bool(steps.start)
        )
        if checkpoint is not None:
            tracker.truncate(checkpoint)
        for step in steps:
            tracker.log(step, {"loss": float(step) + (0.5 if trackers is None else 0.0)})
        tracker.close()
    assert _scalars(tmp_path / "tensorboard") == {
        "loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.5), (6, 6.5)]
    }


def test_a_resume_after_an_attempt_that_died_before_its_record_draws_each_step_once(tmp_path: Path) -> None:
    """The event files hold steps 0-4 and tensorboard/last_step.json says 2 (the attempt died between a flush and
    its record). The resume from the checkpoint at step 3 replays step 3: the purge began after step 3, so step 3
    was drawn twice. It begins after the recorded step: one point per step."""
    pytest.importorskip("tensorboard", reason="the roll-core[track] extra")
    tracker = Tracker(tmp_path, "experiment: died\n")
    for step in range(5):
        tracker.log(step, {"loss": float(step)})
    tracker.close()
    (tmp_path / "tensorboard" / "last_step.json").write_text(json.dumps({"last_step": 2}))
    resumed = Tracker(tmp_path, "experiment: died\n", resume=True)
    resumed.truncate(3)
    resumed.log(4, {"loss": 14.0})
    resumed.close()
    assert _scalars(tmp_path / "tensorboard") == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0)]}


def test_a_resume_in_a_folder_from_before_the_record_replays_nothing(tmp_path: Path) -> None:
    """Event files without tensorboard/last_step.json (written before roll kept it) hold every step: a replay would
    draw each point twice."""
    pytest.importorskip("tensorboard", reason="the roll-core[track] extra")
    tracker = Tracker(tmp_path, "experiment: old\n")
    for step in range(3):
        tracker.log(step, {"loss": float(step)})
    tracker.close()
    (tmp_path / "tensorboard" / "last_step.json").unlink()
    resumed = Tracker(tmp_path, "experiment: old\n", resume=True)
    resumed.truncate(2)
    resumed.log(3, {"loss": 3.0})
    resumed.close()
    assert _scalars(tmp_path / "tensorboard") == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]}


def test_a_fresh_run_in_a_folder_of_an_attempt_that_never_checkpointed_shows_only_its_own_steps(
    tmp_path: Path,
) -> None:
    """A relaunch (or resume=true without a checkpoint) starts metrics.jsonl afresh; TensorBoard showed the earlier
    attempt's steps 0-3 beside the new 0-1."""
    pytest.importorskip("tensorboard", reason="the roll-core[track] extra")
    first = Tracker(tmp_path, "experiment: demo\n")
    for step in range(4):
        first.log(step, {"loss": 10.0 + step})
    first.close()
    again = Tracker(tmp_path, "experiment: demo\n")
    for step in range(2):
        again.log(step, {"loss": float(step)})
    again.close()
    assert _scalars(tmp_path / "tensorboard") == {"loss": [(0, 0.0), (1, 1.0)]}
    assert [r["loss"] for r in Tracker.read_metrics(tmp_path / "metrics.jsonl")] == [0.0, 1.0]


def test_no_trackers_writes_only_the_core_files(tmp_path: Path) -> None:
    cfg = load_config(["pipeline.trackers=[]"])
    assert cfg.pipeline.trackers == []
    assert load_config([]).pipeline.trackers == ["tensorboard"]  # the default
    tracker = Tracker(tmp_path, "experiment: demo\n", cfg.pipeline.trackers)
    tracker.log(1, {"reward/mean": 0.25})
    tracker.samples(1, [{"response": "4", "reward": 1.0}])
    tracker.truncate(1)
    tracker.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "metrics.jsonl", "samples.jsonl"]
    assert Tracker.read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.25}]


def test_without_trackers_tensorboard_is_not_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_core.errors import MissingExtraError, check_installed

    off, default = load_config(["pipeline.trackers=[]"]), load_config([])
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if roll-core[track] were not installed
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    check_installed(off)  # the run's early check asks only for what its trackers need
    Tracker(tmp_path, trackers=off.pipeline.trackers).close()
    with pytest.raises(MissingExtraError, match=r"pip install 'roll-core\[track\]'"):
        check_installed(default)
    with pytest.raises(MissingExtraError, match=r"pip install 'roll-core\[track\]'"):
        Tracker(tmp_path, trackers=default.pipeline.trackers)


def test_unknown_tracker_is_a_config_error_naming_the_installed_ones(tmp_path: Path) -> None:
    installed = registry.available("roll.trackers")
    assert "tensorboard" in installed
    with pytest.raises(ConfigError) as err:
        load_config(["pipeline.trackers=[tensorbord]"])
    message = str(err.value)
    assert "pipeline.trackers=['tensorbord']" in message and "Did you mean 'tensorboard'?" in message
    assert f"installed: {', '.join(installed)}." in message
    assert message.count("no plugin 'tensorbord'") == 1  # said once, not once per chained exception

    # Built directly (a script, not a config), the registry's own error; nothing is written for backends.
    with pytest.raises(registry.PluginNotFoundError, match=r"installed: .*tensorboard"):
        Tracker(tmp_path, trackers=["tensorbord"])
    with pytest.raises(TypeError, match="list of names, not the string 'tensorboard'"):
        Tracker(tmp_path, trackers="tensorboard")
    with pytest.raises(ValueError, match="name a backend twice"):
        Tracker(tmp_path, trackers=["tensorboard", "tensorboard"])
    assert not (tmp_path / "tensorboard").exists()


def test_doctor_lists_each_tracker_and_whether_its_package_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_hw.doctor import tracker_rows

    rows = dict(tracker_rows())
    assert rows["jsonl"] == "ready"  # nothing to install
    assert set(registry.available("roll.trackers")) <= set(rows)
    if importlib.util.find_spec("wandb") is not None:
        assert rows["wandb"].startswith("ready (wandb ")  # with the installed version
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if roll-core[wandb] were not installed
    assert dict(tracker_rows())["wandb"] == "no: pip install 'roll-core[wandb]'"


def test_curves_show_the_agreement_metrics_beside_the_collectors_in_rows_of_four(tmp_path: Path) -> None:
    """curves.png: a panel per key a run logged (absent keys none), four a row, the log-prob gap on a log axis; the
    pipeline loop asks for the collector's keys and the trainer's agreement metrics."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from roll_core.pipelines import loop
    from roll_core.tracking import AGREEMENT_PLOT_KEYS, curve_figure

    assert "AGREEMENT_PLOT_KEYS" in Path(loop.__file__).read_text()
    history = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "eval/accuracy": 0.5,
            "a": 1.0,
            "b": 2.0,
            "actor/train_infer_logprob_diff": 10.0**-s,
            "actor/correction/masked_fraction": 0.01 * s,
        }
        for s in (1, 2, 3)
    ]
    keys = ("reward/mean", "reward/accuracy", "eval/accuracy", "a", "b", *AGREEMENT_PLOT_KEYS)
    fig = curve_figure(history, keys)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    titles = [ax.get_title() for ax in visible]
    assert titles == ["reward/mean", "eval/accuracy", "a", "b", *AGREEMENT_PLOT_KEYS]  # no reward/accuracy panel
    assert len(fig.axes) == 8 and len(visible) == 6  # two rows of four, the last two cells hidden
    scales = {ax.get_title(): ax.get_yscale() for ax in visible}
    assert scales["actor/train_infer_logprob_diff"] == "log" and scales["actor/correction/masked_fraction"] == "linear"
    gap = next(ax for ax in visible if ax.get_title() == "actor/train_infer_logprob_diff")
    assert list(gap.lines[0].get_ydata()) == [0.1, 0.01, 0.001]
    plt.close(fig)
    # A zero gap (identical numerics) keeps a linear axis; nothing logged draws nothing.
    flat = curve_figure([{"step": 1, "actor/train_infer_logprob_diff": 0.0}], AGREEMENT_PLOT_KEYS)
    assert [ax.get_yscale() for ax in flat.axes] == ["linear"]
    plt.close(flat)
    assert curve_figure(history, ("missing",)) is None
    tracker = Tracker(tmp_path, trackers=())
    for h in history:
        tracker.log(h["step"], {k: v for k, v in h.items() if k != "step"})
    assert tracker.plot(keys).stat().st_size > 1000
    tracker.close()


def test_numpy_and_tensor_scalars_are_metrics_and_step_is_not_a_metric_name(tmp_path: Path) -> None:
    import numpy as np
    import torch

    tracker = Tracker(tmp_path, trackers=())
    tracker.log(1, {"a": np.float32(0.5), "b": np.int64(3), "c": torch.tensor(1.5), "d": 2.0, "e": "text", "f": True})
    # numpy's bool, 0-d and one-element arrays were left out silently (not numbers.Real, no numel)
    tracker.log(2, {"g": np.bool_(True), "h": np.array(0.25), "i": np.array([0.5]), "j": np.array([1.0, 2.0])})
    assert Tracker.read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "a": 0.5, "b": 3, "c": 1.5, "d": 2.0, "f": 1.0},
        {"step": 2, "g": 1.0, "h": 0.25, "i": 0.5},
    ]
    with pytest.raises(ValueError, match="may not be named 'step'"):
        tracker.log(2, {"step": 99})
    tracker.close()


def test_integer_metrics_stay_integers_whatever_their_type(tmp_path: Path) -> None:
    """A count computed with numpy (np.int64) or torch was logged as a float (`3.0` in metrics.jsonl and to the
    backends) where the same count as a Python int stayed `3`: a reader taking it as an int got a float. Integers
    are ints whatever their type (numpy scalars, 0-d and one-element arrays and tensors); bools are 0.0/1.0 alike
    (Python's, numpy's, torch's); in a sample row a bool stays a JSON boolean (`true` was written `1.0`)."""
    import numpy as np
    import torch

    sent: list[dict[str, Any]] = []

    class Recorder:
        def log(self, step: int, metrics: dict[str, float]) -> None:
            sent.append(metrics)

        def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
            sent.append(rows[0])

        def truncate(self, last_step: int) -> None:
            pass

        def close(self) -> None:
            pass

    tracker = Tracker(tmp_path, trackers=())
    tracker.backends.append(Recorder())
    counts = {"py": 3, "np": np.int64(3), "u8": np.uint8(3), "np0d": np.array(3), "np1": np.array([3])}
    counts.update({"pt0d": torch.tensor(3), "pt1": torch.tensor([3], dtype=torch.int32)})
    flags = {"b": True, "npb": np.bool_(True), "npb0d": np.array(False), "ptb": torch.tensor(True)}
    tracker.log(1, {**counts, **flags, "x": np.float32(0.5)})
    tracker.samples(1, [{"ok": np.bool_(True), "py_ok": False, "n": np.int64(2), "ids": [np.int32(4)], "r": 1.0}])
    tracker.close()
    want = {**dict.fromkeys(counts, 3), "b": 1.0, "npb": 1.0, "npb0d": 0.0, "ptb": 1.0, "x": 0.5}
    (record,) = Tracker.read_metrics(tmp_path / "metrics.jsonl")
    for got in ({k: v for k, v in record.items() if k != "step"}, sent[0]):
        assert got == want
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
    line = (tmp_path / "metrics.jsonl").read_text()
    assert '"np": 3,' in line and '"pt1": 3,' in line and '"npb": 1.0' in line
    row = {"ok": True, "py_ok": False, "n": 2, "ids": [4], "r": 1.0}
    assert sent[1] == row and [type(sent[1][k]) for k in row] == [bool, bool, int, list, float]
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == {"step": 1, **row}
    assert '"ok": true, "py_ok": false, "n": 2, "ids": [4]' in (tmp_path / "samples.jsonl").read_text()


def test_a_resume_after_a_half_written_last_line_drops_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process killed mid-write leaves a partial last line in metrics.jsonl or samples.jsonl: the resume raised
    JSONDecodeError while building its tracker. The partial line is dropped (logged) and the files are rewritten;
    a bad line in the middle is an error naming the file and the line."""
    import logging

    tracker = Tracker(tmp_path, trackers=())
    for step in range(3):
        tracker.log(step, {"loss": float(step)})
        tracker.samples(step, [{"response": f"r{step}"}])
    tracker.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"step": 3, "respo')
    with caplog.at_level(logging.WARNING):
        resumed = Tracker(tmp_path, trackers=(), resume=True)
        resumed.truncate(1)
    assert "half-written" in caplog.text
    assert [r["step"] for r in Tracker.read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    assert [json.loads(x)["response"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == ["r0", "r1"]
    resumed.close()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2 is not a JSON record"):
        Tracker.read_metrics(tmp_path / "metrics.jsonl")


def test_a_plot_that_cannot_be_written_does_not_end_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """curves.png on a full disk or a flaky network folder: savefig raised into the training loop (the module says
    a plot failure never does). A folder in the file's place stands in for the I/O error."""
    import logging

    pytest.importorskip("matplotlib")
    tracker = Tracker(tmp_path, trackers=())
    tracker.log(1, {"reward/mean": 0.5})
    (tmp_path / "curves.png").mkdir()
    with caplog.at_level(logging.WARNING):
        assert tracker.plot() is None
    assert "curves.png not written" in caplog.text
    tracker.close()


def test_curves_are_redrawn_at_most_every_plot_every_s_unless_forced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A figure costs ~0.4 s on a small CPU and was drawn after every step (a large share of a fast SFT step); the
    loop now forces it only at checkpoints and at the end."""
    import time

    from roll_core import tracking

    pytest.importorskip("matplotlib")
    tracker = Tracker(tmp_path, trackers=())
    tracker.log(1, {"reward/mean": 0.5})
    assert tracker.plot(force=False) == tmp_path / "curves.png"  # the first one is drawn
    assert tracker.plot(force=False) is None  # within PLOT_EVERY_S: skipped
    assert tracker.plot() == tmp_path / "curves.png"  # forced
    clock = time.monotonic() + tracking.PLOT_EVERY_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: clock)
    assert tracker.plot(force=False) == tmp_path / "curves.png"  # due again
    tracker.close()


def test_sample_rows_are_strict_json(tmp_path: Path) -> None:
    """A NaN reward was written as a bare NaN token (not JSON), a numpy float raised TypeError, and a row's own
    `step` relabelled it (a resume then kept or dropped it by the wrong step)."""
    import numpy as np
    import torch

    tracker = Tracker(tmp_path, trackers=())
    tracker.samples(3, [{"reward": float("nan"), "score": np.float32(0.5), "len": torch.tensor(7), "text": "é"}])
    line = (tmp_path / "samples.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}")) == {
        "step": 3,
        "reward": None,
        "score": 0.5,
        "len": 7.0,
        "text": "é",
    }
    with pytest.raises(ValueError, match="may not hold 'step'"):
        tracker.samples(4, [{"step": 1, "text": "x"}])
    tracker.close()


def test_a_truncation_cut_short_leaves_the_history_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed run truncates metrics.jsonl and samples.jsonl to its checkpoint: a crash while writing (here: the
    write fails halfway) leaves the old files, never half of the new one. In place, the history was emptied."""
    import builtins
    import io

    tracker = Tracker(tmp_path, "experiment: demo\n", [])
    for step in (1, 2, 3):
        tracker.log(step, {"reward/mean": step / 4})
        tracker.samples(step, [{"response": str(step), "reward": 1.0}])
    tracker.close()
    before = {p: (tmp_path / p).read_text() for p in ("metrics.jsonl", "samples.jsonl")}
    real_open = builtins.open

    class Crash(OSError):
        pass

    def crashing_open(file, mode="r", *args, **kwargs):  # the first write goes halfway, then the disk is full
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode:
            real_write = f.write

            def write(text: str) -> int:
                real_write(text[: len(text) // 2])
                raise Crash("No space left on device")

            f.write = write
        return f

    resumed = Tracker(tmp_path, "experiment: demo\n", [], resume=True)
    monkeypatch.setattr(builtins, "open", crashing_open)
    monkeypatch.setattr(io, "open", crashing_open)  # (what Path.write_text opens with)
    with pytest.raises(Crash):
        resumed.truncate(1)
    monkeypatch.undo()
    assert {p: (tmp_path / p).read_text() for p in before} == before


def test_redact_config_hides_credentials_and_keeps_the_rest() -> None:
    from roll_core.tracking import redact_config, redact_text

    config = {
        "tracking": {"mlflow": {"tracking_uri": "https://user:tok@mlflow.example:5000/x"}},
        "env": {"reward": {"headers": {"X-API-Key": "k", "Authorization": "Bearer b", "Accept": "json"}}},
        "keys": {"hf_token": "h", "apiKey": "a", "openai_api_key": "o", "db_password": "p", "aws_secret": "s"},
        "kept": {
            "api_key_env": "JUDGE_KEY",
            "max_tokens": 8,
            "tokenizer": "t",
            "ray_token_auth": True,
            "unset": None,
            "eos_token": "</s>",
            "image_token": "<image>",
        },
        "list": [{"token": "t"}, "http://u:p@h/a"],
    }
    assert redact_config(config) == {
        "tracking": {"mlflow": {"tracking_uri": "https://***@mlflow.example:5000/x"}},
        "env": {"reward": {"headers": {"X-API-Key": "***", "Authorization": "***", "Accept": "json"}}},
        "keys": {k: "***" for k in config["keys"]},
        "kept": config["kept"],
        "list": [{"token": "***"}, "http://***@h/a"],
    }
    assert config["tracking"]["mlflow"]["tracking_uri"].startswith("https://user:tok@")  # a copy: the input is kept
    assert (
        redact_text("at https://u:p@h/api failed; see http://h/a@b") == "at https://***@h/api failed; see http://h/a@b"
    )


def test_redact_exception_prints_a_chain_without_credentials() -> None:
    """`raise Ours(redacted message) from library_error` printed the library's message whole in the chain: the
    `user:token@` of the URL in it. The stand-in chain keeps each message (redacted), each type's name and each
    traceback; a chain without credentials is left as it is."""
    import traceback

    from roll_core.tracking import RedactedError, redact_exception

    def library_call(userinfo: str) -> None:  # (a traceback prints these lines: no credential written in them)
        try:
            raise ConnectionRefusedError(f"connect to http://{userinfo}@h:1 refused")
        except ConnectionRefusedError as exc:  # context, and the cause below
            raise OSError(f"API request to https://{userinfo}@h:1/api failed") from exc

    user, token = "bob", "tok3n"
    try:
        library_call(f"{user}:{token}")
    except OSError as exc:
        error = exc
    clean = redact_exception(error)
    assert isinstance(clean, RedactedError)
    assert str(clean) == "builtins.OSError: API request to https://***@h:1/api failed"
    try:
        raise RuntimeError("MLflow at https://***@h:1: cannot start the run") from clean
    except RuntimeError as ours:
        printed = "".join(traceback.format_exception(ours))
    assert "tok3n" not in printed and "bob" not in printed
    assert "builtins.ConnectionRefusedError: connect to http://***@h:1 refused" in printed  # the cause's cause
    assert "in library_call" in printed  # where it was raised: the library's frames are kept
    plain = ValueError("no credentials here")
    assert redact_exception(plain) is plain
    looped = ValueError("http://u:p@h")
    looped.__context__ = ValueError("inner")
    looped.__context__.__context__ = looped  # a chain that loops back
    assert "u:p" not in str(redact_exception(looped))


def test_sample_values_inside_lists_and_dicts_are_strict_json_too(tmp_path: Path) -> None:
    """An agentic episode's sample holds its task row (a dict) and lists: a NaN inside was written as a bare NaN
    token (invalid JSON for any other reader), a numpy number inside raised TypeError into the training loop. A
    value json cannot write at all still raises, and leaves no partial rows in the file."""
    import numpy as np

    tracker = Tracker(tmp_path, trackers=())
    row = {"task": {"x": float("nan"), "y": np.float32(0.5), "ids": (np.int64(3), 4)}, "rewards": [float("inf"), 1.0]}
    tracker.samples(2, [row])
    with pytest.raises(TypeError):
        tracker.samples(3, [{"text": "fine"}, {"when": object()}])
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [json.loads(x, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}")) for x in lines] == [
        {"step": 2, "task": {"x": None, "y": 0.5, "ids": [3, 4]}, "rewards": [None, 1.0]}
    ]
    tracker.close()


def test_backends_get_the_sample_rows_as_written_not_numpy_values(tmp_path: Path) -> None:
    """Backends were passed the collector's raw rows: W&B's table cell and SwanLab's text json.dumps them, and a
    numpy reward or a numpy number in an episode's task row raised TypeError into the training loop (samples.jsonl,
    and a resume's replay, held plain values)."""
    import numpy as np

    class Recorder:
        def __init__(self) -> None:
            self.rows: list[tuple[int, list[dict[str, Any]]]] = []

        def log(self, step: int, metrics: dict[str, float]) -> None:
            pass

        def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
            self.rows.append((step, rows))

        def truncate(self, last_step: int) -> None:
            pass

        def close(self) -> None:
            pass

    from roll_core.trackers.wandb import _cell

    tracker = Tracker(tmp_path, trackers=())
    recorder = Recorder()
    tracker.backends.append(recorder)
    tracker.samples(3, [{"reward": np.float32(0.5), "task": {"seed": np.int64(7), "x": float("nan")}}])
    assert recorder.rows == [(3, [{"reward": 0.5, "task": {"seed": 7, "x": None}}])]
    sent = recorder.rows[0][1][0]
    assert type(sent["reward"]) is float and _cell(sent["reward"]) == 0.5
    assert type(sent["task"]["seed"]) is int  # a numpy seed is an int seed, as a Python one is
    assert json.loads(_cell(sent["task"])) == {"seed": 7, "x": None}  # W&B's cell of a dict: its JSON text
    written = json.loads((tmp_path / "samples.jsonl").read_text())
    assert written == {"step": 3, **sent}  # what a resume replays to the backends
    tracker.close()


def test_a_new_run_or_a_resume_that_drops_steps_leaves_no_stale_curves(tmp_path: Path) -> None:
    """report.md embeds curves.png: a fresh run in the folder of an attempt that never checkpointed kept that
    attempt's picture (shown beside "No metrics were logged" when the new run ended before its first plot), and a
    resume kept the curves of the steps it redoes. A resume that drops nothing keeps it (it is still true)."""
    pytest.importorskip("matplotlib")
    first = Tracker(tmp_path, trackers=())
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": 0.1 * step})
    assert first.plot() == tmp_path / "curves.png"
    first.close()

    resumed = Tracker(tmp_path, trackers=(), resume=True)
    resumed.truncate(3)  # the checkpoint was at the last logged step: the picture is still the history
    assert (tmp_path / "curves.png").is_file()
    resumed.truncate(2)  # step 3 is redone: its point is not the run's any more
    assert not (tmp_path / "curves.png").exists()
    assert resumed.plot(force=False) == tmp_path / "curves.png"  # redrawn at once, not after PLOT_EVERY_S
    resumed.close()

    fresh = Tracker(tmp_path, trackers=())
    assert not (tmp_path / "curves.png").exists()
    assert fresh.plot() is None  # nothing logged yet: no picture, and none of the earlier attempt's
    fresh.close()
