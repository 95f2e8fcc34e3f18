"""`pipeline.trackers=[tensorboard]` (the default): scalar event files under `<run>/tensorboard/`.

Needs the `roll-core[track]` extra. A resumed run's `truncate(last_step)` opens a new writer with
`purge_step=last_step + 1`, so TensorBoard drops the events of the steps the run redoes, and replays from
metrics.jsonl the steps up to `last_step` the event files lack (an attempt that ran with `pipeline.trackers=[]` or
without tensorboard): `tensorboard/last_step.json` records the last step written. A folder without that record
(written before roll kept it) is taken to hold every step. Samples are not recorded (samples.jsonl holds them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from roll_core.errors import TENSORBOARD
from roll_core.trackers.replay import kept_metrics


class TensorBoardTracker:
    """Event files under `<run>/tensorboard/`; redone steps purged on resume."""

    #: What this backend needs installed (roll-doctor and `check_installed` read it).
    extra = TENSORBOARD

    def __init__(self, *, run_dir: Path, config: dict[str, Any], name: str, resume: bool) -> None:
        TENSORBOARD.require()  # torch.utils.tensorboard's own error names neither the package nor the extra
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "tensorboard"
        self.state_path = self.dir / "last_step.json"
        if not resume:  # an earlier attempt in this folder that never checkpointed: its events go, as metrics.jsonl
            for old in self.dir.glob("events.out.tfevents.*"):  # does (they showed its steps beside this run's)
                old.unlink()
            self.state_path.unlink(missing_ok=True)
        self.written = self._recorded_step()
        self.writer: SummaryWriter | None = SummaryWriter(str(self.dir))

    def _recorded_step(self) -> int:
        """The last step the event files hold: the record, else (a folder from before it) a huge number when event
        files exist (nothing to replay), else -1."""
        if self.state_path.exists():
            return int(json.loads(self.state_path.read_text())["last_step"])
        return 2**62 if any(self.dir.glob("events.out.tfevents.*")) else -1

    def _record(self, step: int) -> None:
        """Remember that the event files hold the steps up to `step` (once per step: `log` calls it each time)."""
        if step != self.written:
            self.written = step
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"last_step": step}))
            tmp.replace(self.state_path)  # a crash mid-write keeps the previous record

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Add each metric as a scalar at `step` and flush (a crash loses no logged step)."""
        if self.writer is None:
            raise RuntimeError("TensorBoardTracker.log after close()")
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()
        self._record(step)

    def truncate(self, last_step: int) -> None:
        """Purge the events after `last_step` (a new writer over the same folder), then write the steps up to
        `last_step` that the event files lack, from metrics.jsonl. The purge starts after the last step the record
        names when that is earlier: those replayed steps' events, written by an attempt that died before its record
        said so, were drawn twice."""
        from torch.utils.tensorboard import SummaryWriter

        if self.writer is not None:
            self.writer.close()
        _wait_for_a_later_second(self.dir)
        held = min(self.written, last_step)
        self.writer = SummaryWriter(str(self.dir), purge_step=held + 1)
        for step, metrics in kept_metrics(self.run_dir, last_step, after=held):
            self.log(step, metrics)
        self._record(last_step)

    def close(self) -> None:
        """Flush and close the writer (idempotent)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _wait_for_a_later_second(folder: Path) -> None:
    """Sleep until the clock is past the newest event file's second.

    TensorBoard reads a folder's event files in name order (`events.out.tfevents.<second>.<host>.<pid>.<counter>`):
    a purging writer opened in the same second as the previous file by the same process (a resume in a test or a
    notebook) could sort first, when its counter has more digits, and its purge would then be read before the
    events it drops.
    """
    newest = 0
    for path in folder.glob("events.out.tfevents.*"):
        try:
            newest = max(newest, int(path.name.split(".")[3]))
        except (IndexError, ValueError):  # not a name TensorBoard wrote
            continue
    while time.time() < newest + 1:
        time.sleep(0.05)
