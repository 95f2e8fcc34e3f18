"""The errors a worker group's faults raise and the words of their messages (roll_core.cluster.group, which
re-exports the errors: import them from there)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class WorkerDiedError(RuntimeError):
    """A worker process died during a call; the message names role, rank and node."""


class WorkerRestartedError(WorkerDiedError):
    """A worker died during a `retry=False` call and was restarted: the caller must redo its protocol."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class CallTimeoutError(TimeoutError):
    """A call did not finish within the role's call timeout; the message names role, method, ranks and timeout."""


def wait_all(name: str, nodes: list[str], refs: list[Any], what: str, timeout: float | None) -> list[Any]:
    """Per-rank results of a start-up step (`what`), failing at the first rank that fails: a constructor that
    raised (or a process that died) is a WorkerDiedError naming the rank and quoting Ray's report; a method that
    raised is its own error (its type kept: a ConfigError stays one), noted with the rank. `timeout` (None:
    unbounded) bounds the whole step. `name`: the group's; `nodes`: its ranks' node ids (after its start)."""
    import ray

    deadline = None if timeout is None else time.monotonic() + timeout
    rank_of = {ref: r for r, ref in enumerate(refs)}
    pending, results = list(refs), {}
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            raise WorkerDiedError(
                f"{name}: rank(s) {sorted(rank_of[p] for p in pending)} of its {len(refs)} worker(s) did not "
                f"{what} within {timeout:.0f} s (cluster.placement_timeout_s): Ray could not place them, or they "
                "are still loading; `ray status` shows what the cluster lacks"
            )
        r = rank_of[ready[0]]
        where = f"rank {r}" if what == "start" else f"rank {r} on node {nodes[r]}"
        try:
            results[r] = ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            raise WorkerDiedError(
                f"{name}: {where} failed to {what}; the group's {len(refs)} worker(s) were stopped. "
                f"Ray's report: {ray_report(exc)}"
            ) from exc
        except Exception as exc:
            exc.add_note(f"{name}: {where} failed to {what}; the group's {len(refs)} worker(s) were stopped")
            raise
    return [results[r] for r in range(len(refs))]


def failed_note(name: str, method: str, ranks: list[int], called: int) -> str:
    """The note on a call's error naming the ranks where it failed (the same words on both backends)."""
    return f"{name}.{method}() raised on rank(s) {', '.join(map(str, ranks))} of the {called} called"


def ray_report(exc: BaseException) -> str:
    """Ray's report of a worker's death (its pid and node, and why: killed, OOM, exit detail, a constructor's
    traceback), or the exception's type for an error without a message."""
    return str(exc).strip() or type(exc).__name__


def death_summary(exc: BaseException | None) -> str:
    """One line of Ray's report of a death for a log (the sentence that says why), prefixed for appending."""
    if exc is None:
        return ""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = next((ln for ln in lines if ln.startswith("The actor is dead because")), lines[0] if lines else "")
    return f" ({why[:300]})" if why else ""


def hook_name(hook: Callable[..., Any]) -> str:
    """A restart hook as an error names it: `WeightSync.restore`, a function's qualified name, else its repr."""
    return str(getattr(hook, "__qualname__", None) or repr(hook))


def start_failures_note(
    failures: dict[int, tuple[int, BaseException, str]], ranks: list[int]
) -> tuple[str, BaseException | None]:
    """For an error saying a group's restart budget is spent: the words naming those of `ranks` whose last restart
    attempts failed to start (how many in a row, and the last failure: Ray's report or the timeout), and the last
    such failure (the error's cause); ("", None) when none did. `failures`: rank -> (attempts, error, words)."""
    failed = [r for r in ranks if r in failures]
    words = "".join(
        f". Rank {r} failed to start in its last {failures[r][0]} restart attempt(s); the last failure: "
        f"{failures[r][2]}"
        for r in failed
    )
    return words, (failures[failed[-1]][1] if failed else None)
