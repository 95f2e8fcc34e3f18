"""What the training loop shows per step on the console, and the line it ends a run with.

Contract:
- `progress_fields(out, previous)`: the step's PROGRESS_FIELDS, formatted; the held-out accuracy of the last
  evaluation (in `previous`) stays on a step that did not evaluate.
- `seed_fields(history)`: the fields shown before step 1 is done: the held-out accuracy of the latest evaluation in
  the metrics history (the evaluation before step 1, or a resumed run's last one); {} when none was logged.
- `use_bar(progress, stream)`: a tqdm bar only when `pipeline.progress` is on and `stream` (stderr) is a terminal
  (or a notebook, where tqdm draws a widget). Elsewhere (a log file under nohup, Slurm or a Ray job) tqdm wrote
  every update onto one line separated by carriage returns, unreadable with `tail` or `grep`; and with
  `pipeline.progress=false` nothing was said per step. There `StepReport` logs one plain line per step instead.
- `step_line(step, total, fields)`: that line, `step 3/10 reward=0.410 acc=0.38 eval_acc=0.50 sec=2.9`.
- `StepReport`: the loop's per-step report, one of the two; `step` after each step, `close` at the end.
- `ending_line(status, summary)`: the one line a run that returned ends with (`run finished`, `run stopped by signal
  15 (...)`, a partial job's line), with its headline numbers; the whole summary is the caller's (roll-train prints
  it as JSON, the Python API returns it).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any, TextIO

log = logging.getLogger(__name__)

#: Step metrics shown on the progress bar, in order, when the step has them (RL, SFT, DPO, distillation).
PROGRESS_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/accuracy", "acc", "{:.2f}"),
    ("sft/loss", "loss", "{:.3f}"),
    ("dpo/loss", "loss", "{:.3f}"),
    ("dpo/reward_accuracy", "pref_acc", "{:.2f}"),
    ("distill/kl", "kl", "{:.3f}"),
    ("distill/reverse_kl", "rkl", "{:.3f}"),
    ("rollout/rows", "rows", "{:.0f}"),
    ("eval/accuracy", "eval_acc", "{:.2f}"),
    ("perf/step_seconds", "sec", "{:.1f}"),
)
_EVAL_KEY, _EVAL_SHORT, _EVAL_FMT = next(f for f in PROGRESS_FIELDS if f[0] == "eval/accuracy")


def progress_fields(out: dict[str, Any], previous: dict[str, str] | None = None) -> dict[str, str]:
    """The progress bar's postfix: the PROGRESS_FIELDS the step logged. The held-out accuracy of the last evaluation
    (in `previous`, the last postfix) stays on a step that did not evaluate: the run's headline number was shown
    nowhere in the console until the summary (`acc` is the training batch's). A step that evaluated without an
    accuracy (`eval/n` 0: no held-out episode had an outcome) shows none, not the earlier one as its own."""
    fields = {}
    for key, short, fmt in PROGRESS_FIELDS:
        if out.get(key) is not None:
            fields[short] = fmt.format(out[key])
        elif key == _EVAL_KEY and previous and short in previous and "eval/n" not in out:
            fields[short] = previous[short]
    return fields


def seed_fields(history: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The fields before the first step of this process: the latest held-out accuracy in `history` (the step-0
    evaluation, or a resumed run's last), which the first step's bar showed nothing of; {} when none."""
    for record in reversed(history):
        if record.get(_EVAL_KEY) is not None:
            return {_EVAL_SHORT: _EVAL_FMT.format(record[_EVAL_KEY])}
    return {}


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty (a replaced stream), or a closed file
        return False


def _in_notebook() -> bool:
    """Whether tqdm.auto draws a notebook widget here (its stderr is not a terminal, yet a bar is what one wants)."""
    from tqdm.auto import tqdm

    return any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)


def use_bar(progress: bool, stream: TextIO | None = None) -> bool:
    """Whether the loop shows a tqdm bar: `progress` is on and `stream` (default stderr) is a terminal or a notebook;
    otherwise it logs a line per step (see the module docstring)."""
    if not progress:
        return False
    return _is_terminal(sys.stderr if stream is None else stream) or _in_notebook()


def step_line(step: int, total: int, fields: dict[str, str]) -> str:
    """One step's plain log line: `step <step>/<total>` then the fields as `name=value`."""
    return " ".join([f"step {step}/{total}", *(f"{k}={v}" for k, v in fields.items())])


class StepReport:
    """The loop's per-step console report: a tqdm bar (`desc`, `total` steps, `initial` done before) or, when
    `use_bar` says no, one log line per step. `history`: the metrics logged so far (`seed_fields`)."""

    def __init__(
        self,
        *,
        total: int,
        initial: int,
        desc: str,
        progress: bool,
        history: Sequence[dict[str, Any]],
        stream: TextIO | None = None,
    ) -> None:
        self.total = total
        self.fields = seed_fields(history)
        self.bar: Any = None
        if use_bar(progress, stream):
            from tqdm.auto import tqdm  # looked up here: tests record the bar by replacing tqdm.auto.tqdm

            # Advanced by hand once a step is done: iterating the bar counts a step only when the next one starts,
            # so a stopped (or finished rollout-only) run's bar ended one step short.
            self.bar = tqdm(
                total=total, desc=desc, unit="step", initial=initial, file=stream, postfix=self.fields or None
            )

    def step(self, step: int, out: dict[str, Any]) -> None:
        """Report step `step`, whose metrics are `out`."""
        self.fields = progress_fields(out, self.fields)
        if self.bar is not None:
            self.bar.set_postfix(self.fields, refresh=False)
            self.bar.update(1)
        else:
            log.info("%s", step_line(step, self.total, self.fields))

    def close(self) -> None:
        """Close the bar, if any."""
        if self.bar is not None:
            self.bar.close()


def ending_line(status: str, summary: dict[str, Any]) -> str:
    """The line a run that returned ends with: `run <status>` (`run finished`, `run stopped by signal 15 (resume from
    step_000002)`, ...) and its final and best held-out accuracy, last reward, wall time and folder, where known."""
    parts = []
    for key, name in (("final_eval_accuracy", "final eval_acc"), ("best_eval_accuracy", "best")):
        if summary.get(key) is not None:
            parts.append(f"{name}={summary[key]:.4g}")
    if summary.get("final_reward") is not None:
        parts.append(f"reward={summary['final_reward']:.4g} (step {summary.get('final_reward_step')})")
    if summary.get("wall_seconds") is not None:
        parts.append(f"wall {summary['wall_seconds']:.1f}s")
    if summary.get("output_dir"):
        parts.append(f"in {summary['output_dir']}")
    return f"run {status}" + (f" | {', '.join(parts)}" if parts else "")
