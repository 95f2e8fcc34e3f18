"""A sweep's summary files: `summary.csv`, `summary.md` and `rewards.png` in the sweep folder (moved out of
roll_core.sweep, which keeps the sweep's state, finds its job records and calls `write_summary`).

Contract: `write_summary(sweep_dir, found)` writes one row per job record in `found` (roll_core.sweep_records
`job_records`: (job folder, record) pairs, in job order) and returns the rows:
- summary.csv: every column, the job's overrides included; summary.md: the same table without the overrides (the
  `params` column names the swept values; only the error cell is cut); rewards.png: every job's reward curve from its
  `metrics.jsonl`, one line per job, named with its number (two jobs with the same swept values are two lines).
- Each file is written whole or not at all: a temporary file in the same folder is renamed over it, so a sweep killed
  or failing while it writes leaves the earlier file (or none) and no temporary one. A plot that fails is logged and
  the tables are still written; an error writing a table is raised (roll_core.sweep counts the failures before).
- A job's final held-out accuracy is its run summary's where the record holds one (missing where a stop skipped its
  final evaluation, its error cell saying so), else its metrics.jsonl's last evaluation's own (missing where that
  one had no outcome, `eval/n` 0: the last LOGGED accuracy is an earlier model's; roll_core.eval_history); a missing
  one whose last evaluation had no outcome says so in an empty error cell; best_* values skip NaN; a time not
  recorded is "-", never 0.
- With no job record, summary.md says so and an earlier sweep's summary.csv and rewards.png are removed (never shown as
  this sweep's).
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from roll_core.eval_history import last_eval_accuracy, no_outcome
from roll_core.sweep_records import STATUS_FILE, job_labels

# The sweep's logger: the summary's messages stay under the name they had in roll_core.sweep.
log = logging.getLogger("roll_core.sweep")


def _metrics(job_dir: Path) -> list[dict[str, Any]]:
    # A killed job can leave a half-written last line: skip what does not parse instead of losing the summary.
    from roll_core.report import read_history

    return read_history(job_dir / "metrics.jsonl")


def _seconds(value: Any) -> float | None:
    # None ("-" in the table) when unknown, e.g. a job killed before it wrote its start record: never a fake 0
    return round(float(value), 1) if isinstance(value, (int, float)) else None


def write_summary(sweep_dir: Path, found: list[tuple[Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    """summary.csv, summary.md and rewards.png of the job records `found` (see job_records); returns the rows."""
    records = [st for _, st in found]
    rows: list[dict[str, Any]] = []
    curves: list[tuple[str, list[tuple[int, float]]]] = []
    for (job_dir, st), label in zip(found, job_labels(records)):
        hist = _metrics(job_dir)
        rewards = [(h["step"], h["reward/mean"]) for h in hist if h.get("reward/mean") is not None]
        evals = [h["eval/accuracy"] for h in hist if h.get("eval/accuracy") is not None]
        # best_*: a NaN (a step whose rewards all failed) is never the best, wherever it falls (max() kept a leading
        # NaN and skipped a later one)
        finite_rewards = [r for _, r in rewards if _finite(r)]
        finite_evals = [a for a in evals if _finite(a)]
        final_eval, final_note = _final_eval(st, hist)
        # One curve per job, named with its number: two jobs with the same swept values (a repeat, an Optuna trial
        # that samples a point again) are two lines, not one overwriting the other.
        curves.append((label if label == f"job {st.get('job')}" else f"{st.get('job')}: {label}", rewards))
        rows.append(
            {
                "job": st.get("job"),
                "params": label,
                "status": st.get("status", "unknown"),
                "final_reward": rewards[-1][1] if rewards else None,
                "best_reward": max(finite_rewards, default=None),
                "final_eval_accuracy": final_eval,
                "best_eval_accuracy": max(finite_evals, default=None),
                "wall_seconds": _seconds(st.get("wall_seconds")),
                "queued_seconds": _seconds(st.get("queued_seconds")),
                "error": st.get("error", "") or final_note,
                "overrides": " ".join(st["overrides"]),
            }
        )
    if not rows:
        _write_no_summary(sweep_dir)
        return rows

    def write_csv(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    _replace_atomically(sweep_dir / "summary.csv", write_csv)
    header = [h for h in rows[0] if h != "overrides"]  # the CSV keeps every override; the table the swept ones
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        # Only the error is cut: params is what tells the jobs apart, and its differences may come late in it.
        lines.append("| " + " | ".join(_cell(r[k], 120 if k == "error" else None) for k in header) + " |")
    _replace_atomically(sweep_dir / "summary.md", lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    try:  # a picture: a plotting error (a full disk, a broken backend) must not fail a sweep whose tables are written
        _plot(curves, sweep_dir / "rewards.png")
    except Exception:
        log.exception("sweep: could not draw %s (summary.csv and summary.md are written)", sweep_dir / "rewards.png")
    return rows


def _write_no_summary(sweep_dir: Path) -> None:
    """A sweep with no job record: summary.md says so, and an earlier sweep's summary.csv and rewards.png in the
    folder are removed. They were left as they were, and the stop message and the log sent the user to another
    sweep's jobs as this one's."""
    if not sweep_dir.is_dir():  # nothing to replace, and no folder to say it in
        return
    from roll_core.sweep import sweep_marker  # the sweep's state is kept there (and roll_core.sweep imports this)

    sweep_id = sweep_marker(sweep_dir).get("sweep_id")
    which = f"sweep {sweep_id}" if sweep_id else "this sweep"
    text = (
        f"# No jobs\n\nNo job record ({STATUS_FILE}) of {which} was found under {sweep_dir}: none of its jobs "
        "left one. Records of earlier sweeps into this folder are not this sweep's and are left out.\n"
    )
    _replace_atomically(sweep_dir / "summary.md", lambda tmp: tmp.write_text(text))
    for stale in ("summary.csv", "rewards.png"):
        (sweep_dir / stale).unlink(missing_ok=True)


def _replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` whole or not at all: `write` fills a temporary file in the same folder (one file system: the
    rename is atomic), which then replaces `path`. A sweep killed or failing while it writes leaves the earlier
    file (or none) and no temporary one, never half a summary."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _final_eval(record: dict[str, Any], hist: list[dict[str, Any]]) -> tuple[Any, str]:
    """A job's final held-out accuracy and a note for its error cell: its run summary's where the record holds one
    (None when a stop skipped the final evaluation, whose model the last logged accuracy is not: the note names the
    skipped evaluations), else its metrics.jsonl's last evaluation's own (a failed or killed job: None when that
    evaluation attempted nothing, whose model an earlier logged accuracy is not either). A missing one whose last
    evaluation had no outcome gets that as its note."""
    summary = record.get("summary")
    if not isinstance(summary, dict) or "final_eval_accuracy" not in summary:
        final, note = last_eval_accuracy(hist), ""
    else:
        final, note = summary["final_eval_accuracy"], ""
        skipped = summary.get("skipped") if record.get("status") == "ok" else None
        if isinstance(skipped, list) and skipped:
            note = f"skipped by a stop: {', '.join(map(str, skipped))} (roll-eval the checkpoint)"
    if final is None and not note:
        note = no_outcome(hist) or ""
    return final, note


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _cell(v: Any, limit: int | None = None) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    text = str(v).replace("|", "\\|").replace("\n", " ")
    return text[:limit] if limit is not None else text


def _plot(curves: list[tuple[str, list[tuple[int, float]]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no rewards.png")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pts in curves:
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean")
    ax.grid(alpha=0.3)
    if any(pts for _, pts in curves):
        ax.legend(fontsize=7)
    try:
        fig.tight_layout()
        # format: the temporary file's name does not end in .png
        _replace_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:  # a failed savefig left the figure open (pyplot keeps every open figure)
        plt.close(fig)
