"""How a run that does not end normally says so: the messages the loop (roll_core.pipelines.loop) ends a run with.

Contract: `StopAborted` is the KeyboardInterrupt a second SIGINT/SIGTERM raises while a run stops; `roll-train` prints
its message (which names the latest complete checkpoint to resume from) and exits 128 + its `signum`, the first
signal's number. `save_failure(step, exc, latest, free)` is the one message of a checkpoint save that failed: the step,
the cause in one line (a torch DCP `CheckpointException` by its ranks' errors, not their tracebacks), the checkpoint
left intact (`latest`, or that none exists) and, when the disk is full anywhere in `exc`'s chain of causes or had
less than `FULL_BELOW` bytes (`free`, measured by `free_bytes` when the save failed) left, what to free. `signal_name`
names a signal in these messages (`SIGTERM`; `signal N` for a number the platform does not name). Pure functions of
their arguments (`free_bytes` reads the disk's usage): no logging. The loop imports all three, so
`roll_core.pipelines.loop.StopAborted` (the name roll_core.cli looks up among the loaded modules) stays the same class.
"""

from __future__ import annotations

import errno
import signal
from pathlib import Path
from typing import Any

from roll_core.errors import exception_chain


class StopAborted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM aborted a stopping run (its step, its checkpoint save, its wrap-up or its shutdown):
    `roll-train` prints the message, which names the checkpoint left to resume from, and exits 128 + `signum` (the
    first signal). It was a KeyboardInterrupt traceback, exit 1 (report.md: `failed: KeyboardInterrupt:`)."""

    def __init__(self, signum: int, latest: Path | None, steps_over: bool = False) -> None:
        self.signum = signum
        left = (
            f"the latest complete checkpoint is {latest}: pipeline.resume=true continues from it"
            if latest is not None
            else "no checkpoint was written: a new run starts from step 1"
        )
        during = (
            "ending the run (its steps were over: final curves, trackers, shutdown)"
            if steps_over
            else "stopping: the step in progress and any checkpoint being written were dropped"
        )
        super().__init__(f"aborted by a second {signal_name(signum)} while {during}; {left}")


def signal_name(signum: int | None) -> str:
    """`SIGTERM` for 15 (a number the platform does not name as it is)."""
    try:
        return signal.Signals(signum).name  # type: ignore[arg-type]
    except ValueError:
        return f"signal {signum}"


#: A save that failed with less than this many bytes free on its disk failed for want of space: torch's zip writer
#: (an optimizer's DCP shard) reports a full disk as "unexpected pos N vs M", without ENOSPC.
FULL_BELOW = 16 * 2**20


def free_bytes(folder: Path) -> int | None:
    """Bytes free on the disk holding `folder` (or its nearest existing parent); None when that cannot be read."""
    import shutil

    for where in (folder, *folder.parents):
        if where.exists():
            try:
                return shutil.disk_usage(where).free
            except OSError:
                return None
    return None


def _rank_errors(exc: BaseException) -> dict[Any, BaseException]:
    """The failed ranks' errors of torch's DCP CheckpointException (`failures`: rank -> (error, stack)); {} else."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return {}
    errors = {r: f[0] if isinstance(f, tuple) and f else f for r, f in failures.items()}
    return {r: e for r, e in errors.items() if isinstance(e, BaseException)}


def _one_line_cause(exc: BaseException) -> str:
    """`Type: message` of `exc`; for a CheckpointException (whose str is every rank's traceback) its ranks' errors."""
    ranks = _rank_errors(exc)
    if ranks:
        return f"{type(exc).__name__}: " + "; ".join(
            f"rank {r}: {type(e).__name__}: {str(e).strip()}" for r, e in ranks.items()
        )
    return f"{type(exc).__name__}: {exc}"


def save_failure(step: int, exc: BaseException, latest: Path | None, free: int | None = None) -> str:
    """The message of a checkpoint save that failed with `exc`; `latest`: the complete checkpoint left; `free`: the
    bytes free on its disk when it failed (None: unknown)."""
    cause = _one_line_cause(exc)
    full = (free is not None and free < FULL_BELOW) or any(
        (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left on device" in str(e)
        for e in [*exception_chain(exc), *(c for r in _rank_errors(exc).values() for c in exception_chain(r))]
    )
    where = (
        f"the latest complete checkpoint, {latest}, is intact: pipeline.resume=true continues from it"
        if latest is not None
        else "no earlier checkpoint exists: the run starts again from step 1"
    )
    hint = " The disk is full: free space (or lower pipeline.keep_last) before resuming." if full else ""
    failed = f"step {step}: the checkpoint could not be written ({cause})"
    from roll_core.checkpoint import UnsureCheckpointError

    unsure = next((e for e in exception_chain(exc) if isinstance(e, UnsureCheckpointError)), None)
    if unsure is not None:  # its rename may not be on disk and could not be undone: it is listed, not known intact
        return (
            f"{failed}; {unsure.folder} is listed as the latest checkpoint but may not be on disk: check that the "
            f"disk holds it whole (or delete it) before resuming.{hint}"
        )
    return f"{failed}; its partial folder was deleted and {where}.{hint}"
