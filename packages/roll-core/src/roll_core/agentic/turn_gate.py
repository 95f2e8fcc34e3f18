"""Admission of an agentic rollout's turn requests around weight syncs (`TurnGate`), and the wait for each turn's
result, bounded where the gate aborted the request.

Contract:
- `enter(request_id)` blocks while a sync runs (`begin_update` .. `finish_update`), then registers the request as
  running and returns the weight version it is sampled under; `leave(request_id)` unregisters it (the caller calls
  it in a `finally`) and says whether the gate aborted it for a sync (the caller resumes the turn after the sync).
- `begin_update` stops admitting turns; with partial rollout it aborts the running ones, otherwise it lets them
  finish (at most `sync_wait_s`: pipeline.agentic_sync_wait_s); it returns when none runs; past its bound it raises
  a TimeoutError naming the requests still running and the config key that sets the bound. `finish_update(version)`
  admits turns again. `close` refuses new turns and aborts the running ones. `abort(request_id)` aborts one running
  request whose caller ends (an agent session closed: roll_core.agentic.agent_sessions); `leave` says False for it
  (nothing to resume).
- `wait(request_id, handle)` is how a turn reads its result (`handle`: what `InferGroup.submit_request` returns,
  with `done()` and `result(timeout)`).

Requests that never return. A request the gate aborted (at a sync or at `close`) normally brings its partial result
within moments. If its handle has not completed `abort_timeout_s` after the abort (the engine restarted, its worker
died, the abort was lost), or its `result()` raises, it is lost: `wait` returns None and the caller resumes the turn
with what its earlier attempts generated (what the lost request generated is gone), or after `close` ends the
episode `abort`. Counted in `async/unanswered_aborts` and `async/failed_aborts` (`stats`), with one warning per
version (the first loss at once, the rest summed up at the next `finish_update`); a request lost after `abort` is
warned about on its own (its caller's end is an event of its own, and a gate without syncs has no next version).
So a sync waits for its aborts about `abort_timeout_s` at most and goes on, no id of such a request stays in the
gate, and no episode thread (with its environment slot) blocks for good on a handle that never completes. A
request the gate did NOT abort whose handle raises is an engine failure: `wait` raises it (the rollout names the
turn); it is never retried or dropped silently.

A request the gate aborted before it reached the engine (between `enter` and `submit_request`: the abort found
nothing to abort) is aborted again when its turn starts waiting on it, so the sync neither waits for its whole
generation nor loses it to the bound.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: Default of `sync_wait_s` (pipeline.agentic_sync_wait_s): how long a sync without partial rollout waits for the
#: running turns to finish on their own.
SYNC_WAIT_S = 600.0
#: Default of `abort_timeout_s` (pipeline.async_abort_timeout_s).
ABORT_TIMEOUT_S = 60.0
#: The longest a turn blocks on its handle between two looks at whether the gate aborted it (Ray: one `ray.wait`).
POLL_MAX_S = 2.0
CAUSES = ("unanswered_aborts", "failed_aborts")
_PENDING = object()


class GateClosed(RuntimeError):
    """The collector shut down while an episode waited to submit a turn."""


def result_within(handle: Any, timeout_s: float) -> Any:
    """`handle`'s result if it completes within `timeout_s`, else `_PENDING`; raises what its `result()` raises."""
    try:
        return handle.result(timeout=timeout_s)
    except TimeoutError:  # (concurrent.futures' and Ray's too) not finished, or a request failing with one
        if not handle.done():
            return _PENDING
    return handle.result()  # finished meanwhile, or its own error was a TimeoutError: read it for real


class TurnGate:
    """Admission of turn requests around weight syncs (see the module docstring). Thread-safe.

    Args:
        infer: the inference group (`abort(request_id)`).
        partial_rollout: abort the running turns at `begin_update` (resumed after the sync) instead of waiting.
        abort_timeout_s: how long a request the gate aborted may take to bring its result before it is lost.
        sync_wait_s: how long a sync without partial rollout waits for the running turns to finish.
    """

    def __init__(
        self,
        infer: Any,
        *,
        partial_rollout: bool,
        abort_timeout_s: float = ABORT_TIMEOUT_S,
        sync_wait_s: float = SYNC_WAIT_S,
    ) -> None:
        if not abort_timeout_s > 0:
            raise ValueError(f"abort_timeout_s={abort_timeout_s} must be > 0 (seconds an abort may take to return)")
        if not (math.isfinite(sync_wait_s) and sync_wait_s > 0):
            raise ValueError(f"sync_wait_s={sync_wait_s} must be a finite number > 0 (seconds a sync waits for turns)")
        self.infer, self.partial_rollout, self.abort_timeout_s = infer, partial_rollout, abort_timeout_s
        self.sync_wait_s = sync_wait_s
        self.version = 0
        self._cv = threading.Condition()
        self._paused = self._closed = False
        # Running requests -> when they entered (a batch that times out says how long each has run).
        self._running: dict[str, float] = {}
        self._aborted: dict[str, float] = {}  # running requests the gate aborted -> when (until they leave)
        self._ended: set[str] = set()  # ... of those, the ones `abort` ended (their callers do not resume them)
        self._counters = dict.fromkeys(CAUSES, 0)  # requests lost, by cause
        self._last = dict.fromkeys(CAUSES, 0)  # ... at the previous `stats`
        self._warned_version = -1  # the version whose first loss was warned about (one warning per version)
        self._unwarned = dict.fromkeys(CAUSES, 0)  # losses since that warning: summed up at finish_update

    def enter(self, request_id: str) -> int:
        """Wait while a sync runs, then register `request_id` as running; returns the current weight version."""
        with self._cv:
            while self._paused and not self._closed:
                self._cv.wait()
            if self._closed:
                raise GateClosed("the collector is closed")
            self._running[request_id] = time.monotonic()
            return self.version

    def wait(self, request_id: str, handle: Any) -> Any:
        """The result of the running request `request_id` (entered, submitted as `handle`); None when the gate
        aborted it and it is lost (module docstring). Raises the handle's error for a request the gate did not
        abort."""
        with self._cv:
            again = request_id in self._aborted
        if again:  # aborted before the engine knew it: the engine knows it now
            self.infer.abort(request_id)
        step = min(self.abort_timeout_s / 4, POLL_MAX_S)  # a loss is seen within a quarter of the bound
        while True:
            try:
                out = result_within(handle, step)
            except Exception as exc:
                with self._cv:
                    if request_id not in self._aborted:
                        raise  # an engine failure (module docstring)
                    warn = self._lose("failed_aborts", request_id)
                self._warn(warn, request_id, f"its result raised {type(exc).__name__}: {exc}")
                return None
            if out is not _PENDING:
                return out
            with self._cv:
                at = self._aborted.get(request_id)
                if at is None or time.monotonic() - at < self.abort_timeout_s or handle.done():
                    continue  # not aborted, within the bound, or completed just now (its partial result is kept)
                warn = self._lose("unanswered_aborts", request_id)
            self._warn(warn, request_id, f"no result within {self.abort_timeout_s} s of its abort")
            return None

    def leave(self, request_id: str) -> bool:
        """The request returned or was lost; True when the gate aborted it for a sync (resume it after the sync)."""
        with self._cv:
            self._running.pop(request_id, None)
            self._cv.notify_all()
            aborted = self._aborted.pop(request_id, None) is not None
            ended = request_id in self._ended
            self._ended.discard(request_id)
            return aborted and not self._closed and not ended

    def abort(self, request_id: str) -> None:
        """Abort `request_id` for good (its caller ends, e.g. an agent session closed): its wait is bounded as a
        sync's abort is (module docstring), and `leave` says False. A request not running (not entered yet, or
        left) is only aborted in the engine: its caller checks its own state after `enter`."""
        with self._cv:
            if request_id in self._running:
                self._mark_aborted([request_id])
                self._ended.add(request_id)
        self.infer.abort(request_id)

    def begin_update(self, timeout_s: float | None = None) -> None:
        """Stop admitting turns; abort running ones (partial rollout) or let them finish; wait until none runs.
        `timeout_s` (default: `abort_timeout_s` plus a margin with partial rollout, `sync_wait_s` without) bounds
        the wait: past it a TimeoutError names the requests still running and the config key to raise."""
        with self._cv:
            self._paused = True
            running = list(self._running) if self.partial_rollout else []
            self._mark_aborted(running)
        for rid in running:
            self.infer.abort(rid)
        if timeout_s is None:
            # The aborted turns are collected or lost after abort_timeout_s (plus one poll step): a wait past the
            # margin means a thread is stuck.
            margin = max(self.abort_timeout_s, 10.0)
            timeout_s = self.abort_timeout_s + margin if self.partial_rollout else self.sync_wait_s
        with self._cv:
            if not self._cv.wait_for(lambda: not self._running, timeout=timeout_s):
                still = sorted(self._running)
                if self.partial_rollout:  # aborted, yet not collected nor lost: a turn's thread is stuck
                    why = "they were aborted and are bounded by pipeline.async_abort_timeout_s: a turn's thread hangs"
                else:  # long turns (many tokens, a slow engine) may need more than the default
                    why = (
                        "the sync lets running turns finish: raise pipeline.agentic_sync_wait_s, or set "
                        "pipeline.partial_rollout=true to abort them instead"
                    )
                raise TimeoutError(
                    f"{len(still)} turn request(s) still running {timeout_s}s into a weight sync "
                    f"({why}): {', '.join(still[:5])}{' ...' if len(still) > 5 else ''}"
                )

    def finish_update(self, version: int) -> None:
        """The engines hold weight version `version`: admit turns again."""
        with self._cv:
            unwarned = {c: n for c, n in self._unwarned.items() if n}
            self._unwarned = dict.fromkeys(CAUSES, 0)
            lost_at = self.version
            self.version, self._paused = version, False
            self._cv.notify_all()
        if unwarned:
            log.warning(
                "async episodes: %d more aborted turn request(s) lost at version %d (%s): forgotten, their turns "
                "resume with what earlier attempts generated",
                sum(unwarned.values()),
                lost_at,
                ", ".join(f"async/{cause} {n}" for cause, n in sorted(unwarned.items())),
            )

    @property
    def closed(self) -> bool:
        """Whether `close` ran (an abort seen after it is the shutdown's, not one to resume)."""
        with self._cv:
            return self._closed

    def running(self) -> list[str]:
        """The requests running now (entered, not yet left)."""
        with self._cv:
            return sorted(self._running)

    def running_since(self) -> dict[str, float]:
        """The requests running now -> when each entered (`time.monotonic()`: just before its submit)."""
        with self._cv:
            return dict(self._running)

    def stats(self) -> dict[str, float]:
        """Aborted requests lost since the previous call, by cause (`async/unanswered_aborts`,
        `async/failed_aborts`)."""
        with self._cv:
            now = dict(self._counters)
            out = {f"async/{c}": float(now[c] - self._last[c]) for c in CAUSES}
            self._last = now
            return out

    def close(self) -> None:
        """Refuse new turns and abort the running ones (their episodes end with `abort`)."""
        with self._cv:
            self._closed = True
            running = list(self._running)
            self._mark_aborted(running)  # their waits are bounded too: close does not hang on a deaf engine
            self._cv.notify_all()
        for rid in running:
            self.infer.abort(rid)

    # ---- internals -----------------------------------------------------------------------------------------
    def _mark_aborted(self, rids: list[str]) -> None:
        """`rids` are about to be aborted (lock held): the bound runs from the first abort of each."""
        now = time.monotonic()
        for rid in rids:
            self._aborted.setdefault(rid, now)

    def _lose(self, cause: str, request_id: str) -> int | None:
        """Count a lost request (lock held); returns the version to warn about if it is that version's first, or
        the request was ended by `abort` (warned on its own: module docstring)."""
        self._counters[cause] += 1
        if request_id in self._ended:
            return self.version
        if self._warned_version != self.version:
            self._warned_version = self.version
            return self.version
        self._unwarned[cause] += 1
        return None

    def _warn(self, version: int | None, request_id: str, what: str) -> None:
        """The warning about `version`'s first lost request (None: not the first, summed up at finish_update)."""
        if version is None:
            return
        with self._cv:
            ended, closed = request_id in self._ended, self._closed
        if ended:
            then = "its caller ends (its session closed)"
        elif closed:
            then = "its episode ends (the collector closed)"
        else:
            then = "its turn resumes with what earlier attempts generated"
        log.warning(
            "async episodes: aborted turn request %s lost at version %d: %s; forgotten, %s (an engine restart or a "
            "lost worker?)",
            request_id,
            version,
            what,
            then,
        )
