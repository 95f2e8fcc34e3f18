"""`pipeline.trackers=[jsonl]`: only the run folder's own files, named explicitly.

The core `Tracker` always writes `metrics.jsonl`, `samples.jsonl` and `config.yaml` (every run's summary, resume and
sweep table read them), so this backend writes nothing itself: the name exists so that `trackers=[jsonl]` reads as
what it means ("only the JSONL files") and so that a list such as `[jsonl,wandb]` is explicit about the local copy.
`trackers=[]` is the same run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class JsonlTracker:
    """Accepts every call and records nothing beyond the core files (see the module docstring)."""

    extra = None  # nothing to install
    keeps_records = False  # the core files are its record: never stale (roll_core.trackers._away)

    def __init__(self, *, run_dir: Path, config: dict[str, Any], name: str, resume: bool) -> None:
        self.run_dir = Path(run_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Nothing: metrics.jsonl already holds the step."""

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Nothing: samples.jsonl already holds the rows."""

    def truncate(self, last_step: int) -> None:
        """Nothing: the core files are truncated by the Tracker."""

    def close(self) -> None:
        """Nothing to release."""
