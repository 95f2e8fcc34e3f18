"""Run tracking: metrics JSONL, TensorBoard events, the resolved config, sample completions and curve plots.

Everything lands in the run's output folder: `metrics.jsonl` (one JSON object per step), `tensorboard/`
(event files), `config.yaml`, `samples.jsonl` (a few decoded completions per step) and `curves.png`
(reward, accuracy and held-out accuracy against step). Writing never raises into the training loop for a plot
failure; a metric that is not a finite number is logged as null in JSONL and skipped in TensorBoard.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Tracker:
    """Writes metrics to JSONL and TensorBoard; plots curves on demand."""

    def __init__(
        self, out_dir: str | Path, config_yaml: str | None = None, tensorboard: bool = True, resume: bool = False
    ) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if config_yaml is not None:
            (self.dir / "config.yaml").write_text(config_yaml)
        self.metrics_path = self.dir / "metrics.jsonl"
        if not resume and self.metrics_path.exists():
            self.metrics_path.unlink()
        self.history: list[dict[str, Any]] = self.read_metrics(self.metrics_path) if resume else []
        self.writer = None
        if tensorboard:
            from roll_core.errors import TENSORBOARD

            TENSORBOARD.require()  # torch.utils.tensorboard's own error names neither the package nor the extra
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tensorboard"))

    @staticmethod
    def read_metrics(path: str | Path) -> list[dict[str, Any]]:
        """All records of a metrics.jsonl (empty when the file is missing)."""
        path = Path(path)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def truncate(self, last_step: int) -> None:
        """Drop records after `last_step` (a resumed run re-does the steps after its checkpoint): metrics,
        samples, and TensorBoard events (purged from `last_step + 1` on by a new writer)."""
        self.history = [h for h in self.history if h["step"] <= last_step]
        self.metrics_path.write_text("".join(json.dumps(h) + "\n" for h in self.history))
        samples = self.dir / "samples.jsonl"
        if samples.exists():
            keep = [line for line in samples.read_text().splitlines() if json.loads(line).get("step", 0) <= last_step]
            samples.write_text("".join(line + "\n" for line in keep))
        if self.writer is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer.close()
            self.writer = SummaryWriter(str(self.dir / "tensorboard"), purge_step=last_step + 1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {
            k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) or v is None
        }
        record = {"step": step, **clean}
        self.history.append(record)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for k, v in clean.items():
                if v is not None:
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        with open(self.dir / "samples.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def plot(self, keys: tuple[str, ...] = ("reward/mean", "reward/accuracy", "eval/accuracy")) -> Path | None:
        """Write curves.png with one panel per key present in the history."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("matplotlib is not installed: no curves.png")
            return None
        present = [k for k in keys if any(h.get(k) is not None for h in self.history)]
        if not present:
            return None
        fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.4), squeeze=False)
        for ax, key in zip(axes[0], present):
            pts = [(h["step"], h[key]) for h in self.history if h.get(key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self.dir / "curves.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def close(self) -> None:
        """Flush and close TensorBoard's writer (idempotent)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
