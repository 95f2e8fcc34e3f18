"""What a run folder's own files hold up to a step, for trackers that cannot delete points: on a resume that redoes
steps they start a fresh remote run and replay these (W&B, MLflow, SwanLab); a run that continues its remote run
replays the steps the remote run lacks (an attempt that ran without the tracker, or died with points unsent)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of `path`, one per non-empty line; [] when the file does not exist; a half-written last
    line is dropped (roll_core.tracking.read_records)."""
    from roll_core.tracking import read_records

    return read_records(Path(path))


def kept_metrics(run_dir: Path, last_step: int, after: int = -1) -> list[tuple[int, dict[str, float]]]:
    """(step, finite numeric metrics) of every metrics.jsonl record of a step in (`after`, `last_step`], in file
    order."""
    kept = []
    for record in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        step = int(record["step"])
        if after < step <= last_step:
            metrics = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            kept.append((step, {k: v for k, v in metrics.items() if math.isfinite(v)}))
    return kept


def kept_samples(run_dir: Path, last_step: int, after: int = -1) -> dict[int, list[dict[str, Any]]]:
    """samples.jsonl's rows (without their `step`) grouped by step, steps in (`after`, `last_step`]."""
    samples: dict[int, list[dict[str, Any]]] = {}
    for row in read_jsonl(Path(run_dir) / "samples.jsonl"):
        step = int(row.pop("step", 0))
        if after < step <= last_step:
            samples.setdefault(step, []).append(row)
    return samples
