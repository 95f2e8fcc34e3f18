"""An out-of-tree tracker (entry point `roll.trackers: dummy_record`): every call it gets, one JSON line each.

It exists to prove that a package outside roll adds a metrics sink the way roll-core adds `tensorboard`: one class
satisfying `roll_core.interfaces.tracking.SampleTrackerBackend`, declared under `roll.trackers`, picked with
`pipeline.trackers=[dummy_record]`. The lines go to `<run>/dummy_tracker.jsonl`, so a test reads exactly what a
remote service (W&B, MLflow) would have been sent, in order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The file a RecordingTracker appends to, inside the run folder.
FILE = "dummy_tracker.jsonl"


class RecordingTracker:
    """Appends `{"call": "open" | "log" | "samples" | "truncate" | "close", ...}` lines to the run folder's FILE."""

    def __init__(self, *, run_dir: Path, config: dict[str, Any], name: str, resume: bool) -> None:
        self.path = Path(run_dir) / FILE
        self.closed = False
        seed = config.get("pipeline", {}).get("seed")  # proves the resolved config arrives as plain containers
        self._write({"call": "open", "name": name, "resume": resume, "seed": seed})

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record `step`'s metrics."""
        self._write({"call": "log", "step": step, "metrics": metrics})

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Record `step`'s completions."""
        self._write({"call": "samples", "step": step, "rows": rows})

    def truncate(self, last_step: int) -> None:
        """Record the truncation (a real service would delete or overwrite the later steps)."""
        self._write({"call": "truncate", "last_step": last_step})

    def close(self) -> None:
        """Record the first close only (idempotent, as the contract asks)."""
        if not self.closed:
            self.closed = True
            self._write({"call": "close"})
