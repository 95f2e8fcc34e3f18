"""What a run says when it ends: its summary (`run_summary`) and the status line the summary and report.md carry
(`end_status`), with the evaluations a stop skipped (`restored_skips`: the ones a checkpoint carries over a resume).

Contract (pure functions of their arguments: no I/O, no logging; `end_status` may add `incomplete` to the summary):
- `run_summary` reads the run's metrics history as a resume leaves it (the earlier processes' steps up to the
  checkpoint, then this process's) and `skipped_evals`, the steps whose due evaluation a stop skipped (every
  process's: the loop checkpoints them, `skipped_evals` in state.json). `final_eval_accuracy` is the last logged
  held-out accuracy, except for a complete run (`signum` None) whose last logged step is a skipped one: None, whether
  the skip was this process's (a signal in the last step) or an earlier one's (a resume that trains nothing), since
  an earlier step's accuracy would pass for the final model's; None too when the last evaluation logged no accuracy
  (`eval/n` 0: an episode collector none of whose held-out episodes had an outcome; the one rule,
  roll_core.eval_history's `last_eval_accuracy`). `skipped` names every skipped evaluation, the final one as
  `final evaluation (step N)`.
- `end_status` is `stopped by signal N (resume from <checkpoint> | no checkpoint to resume from)` for a stopped run;
  for a complete one `finished`, or, when evaluations were skipped, `finished: every step trained ...; <who> skipped
  the <evaluations>` with the roll-eval command's checkpoint for a skipped final evaluation (`<who>`: the signal
  received at the end of this process, else a stop before the resume); a finite job (rollout-only) that
  pipeline.max_steps cut is reported partial and its summary gets `incomplete`.
- `restored_skips` is the checkpoint's skipped steps up to its own step (a later one is another run's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from roll_core.checkpoint import step_of
from roll_core.eval_history import last_eval_accuracy
from roll_core.pipelines._run_endings import signal_name
from roll_core.pipelines.empty_steps import total


def run_summary(
    history: list[dict[str, Any]],
    skipped_evals: list[int],
    *,
    wall_seconds: float,
    output_dir: str,
    signum: int | None,
    late: int | None,
    collector_summary: dict[str, Any],
) -> dict[str, Any]:
    """The run's summary: final, best and first held-out accuracy, the last logged reward (`final_reward`) and its
    step (`final_reward_step`), wall time, folder, `stopped_by_signal` (`signum`), `late_signal` (`late`),
    `skipped`, `empty_steps`, then the collector's own entries (see the module docstring)."""
    evals = [h["eval/accuracy"] for h in history if h.get("eval/accuracy") is not None]
    # the last evaluation's own accuracy: an episode collector's with no outcome (eval/n 0) logs none, and the one
    # before it passed for the final model's (a sweeper optimised it); the rule the report and sweeps read too
    final = last_eval_accuracy(history)
    rewards = [(h["step"], h["reward/mean"]) for h in history if h.get("reward/mean") is not None]
    last = max((h["step"] for h in history), default=None)
    final_skipped = signum is None and last in skipped_evals  # (a late signal skipped it, maybe before a resume)
    return {
        "final_eval_accuracy": final if not final_skipped else None,
        "best_eval_accuracy": max(evals, default=None),
        "first_eval_accuracy": evals[0] if evals else None,
        # the last step that logged one: a last step without a reward (empty, its rewards all failed) read None
        "final_reward": rewards[-1][1] if rewards else None,
        "final_reward_step": rewards[-1][0] if rewards else None,
        "wall_seconds": wall_seconds,
        "output_dir": output_dir,
        "stopped_by_signal": signum,
        "late_signal": late,
        "skipped": [
            f"{'final evaluation' if final_skipped and n == last else 'evaluation'} (step {n})" for n in skipped_evals
        ],
        "empty_steps": total(history),  # steps that trained nothing (not by design), earlier processes' too
        **collector_summary,
    }


def end_status(
    summary: dict[str, Any],
    history: list[dict[str, Any]],
    *,
    healthy_checkpoint: Path | None,
    stop_checkpoint: Path | None,
    exhausted: Any,
    max_steps: int,
) -> str:
    """The status line of a run that returned `summary` (see the module docstring). `healthy_checkpoint`: the latest
    checkpoint saved outside a non-finite streak; `stop_checkpoint`: the one a stopped run resumes from; `exhausted`:
    the collector's (False: a finite job not done). Sets `summary["incomplete"]` for a partial finite job."""
    signum = summary.get("stopped_by_signal")
    if signum:
        where = f"resume from {stop_checkpoint.name}" if stop_checkpoint is not None else "no checkpoint to resume from"
        return f"stopped by signal {signum} ({where})"
    if exhausted is False:
        # a finite job (rollout-only) cut by pipeline.max_steps: its output is partial, which "finished" hid
        status = (
            f"stopped at pipeline.max_steps={max_steps} before the job was done "
            "(partial output; raise pipeline.max_steps and resume with pipeline.resume=true)"
        )
        summary["incomplete"] = True
        return status
    late = summary.get("late_signal")
    skipped = summary.get("skipped") or []
    if not late and not skipped:
        return "finished"
    # complete: a signal stopped nothing but an evaluation (this process's, or one before the resume)
    what = f"skipped the {', '.join(skipped)}" if skipped else "skipped nothing"
    final_skipped = any(s.startswith("final evaluation") for s in skipped)
    if skipped and healthy_checkpoint is not None and (late or final_skipped):
        what += f" (roll-eval {healthy_checkpoint} gives it)"
    last = max((h["step"] for h in history), default=None)
    saved = ""
    if healthy_checkpoint is not None:  # not the last step's inside a non-finite streak (no checkpoint there)
        ckpt = healthy_checkpoint
        saved = f" and saved ({ckpt.name})" if step_of(ckpt) == last else f" (latest checkpoint {ckpt.name})"
    who = f"{signal_name(late)} received at the end" if late else "a stop before the resume"
    return f"finished: every step trained{saved}; {who} {what}"


def restored_skips(state: dict[str, Any]) -> list[int]:
    """The steps whose evaluation a stop skipped, as checkpoint `state` (its state.json) records them: up to its step
    (none in a checkpoint written before they were recorded)."""
    return [int(s) for s in state.get("skipped_evals", ()) if int(s) <= state["step"]]
