"""`roll-eval` stopped by SIGINT/SIGTERM (Ctrl-C, a scheduler's stop or time limit) while it evaluates.

Contract: inside `EvalStop` the first SIGINT/SIGTERM raises `EvalStopped` (a KeyboardInterrupt) where the evaluation
is; its engines are shut down as after any error (roll_core.evaluate). roll-eval then writes the results of the
models it had finished (report.md warns which were not evaluated: `stop_note`), says so in one line
(`stop_line`) and exits 128 + N. Before, Ctrl-C was a KeyboardInterrupt traceback with exit 1 and SIGTERM killed
the process outright: either way the checkpoints of a run folder already evaluated (hours of a benchmark) were
lost, nothing was written. After the stop (writing the results) a signal has its default meaning again. Handlers
are installed from the main thread only (signals are delivered there).
"""

from __future__ import annotations

import signal
from types import FrameType

from roll_core.stop_signals import StopSignals


class EvalStopped(KeyboardInterrupt):
    """The stop signal `signum` arrived while roll-eval evaluated."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class EvalStop(StopSignals):
    """Context manager: SIGINT/SIGTERM raise `EvalStopped` inside it; the earlier handlers are restored on exit."""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        raise EvalStopped(signum)


def stop_line(signum: int, current: str, done: int, total: int) -> str:
    """roll-eval's one line after a stop while it evaluated model `current` (`done` of `total` finished)."""
    name = signal.Signals(signum).name
    if not done:
        return f"roll-eval: stopped by {name} while evaluating {current}: no model was evaluated, nothing was written"
    return (
        f"roll-eval: stopped by {name} while evaluating {current}: writing the results of the {done} of {total} "
        "models evaluated (report.md lists the others)"
    )


def stop_note(signum: int, left: list[str]) -> str:
    """The report.md warning of a stopped evaluation: a head line, the models not evaluated, what to do (the form
    of roll_core.report.write_eval_report's notes)."""
    return (
        f"the evaluation was stopped by {signal.Signals(signum).name}: {len(left)} model(s) were not evaluated\n"
        + "\n".join(left)
        + "\nEvaluate them with roll-eval (another --out) to compare them with these."
    )
