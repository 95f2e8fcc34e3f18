"""A request engine whose requests run until the test acts on them, for tests of requests that never return
(roll_core.agentic.turn_gate, roll_core.agentic.agent_sessions, roll_core.scheduling.driver: "Requests that never
return"). No Ray, no model, no pytest.

- `HeldRequestEngine`: the request API of an inference group (`submit_request`, `abort`, `check_sampling`, as
  `InferGroup`; `check_sampling` accepts everything). A submitted request is held in `running` until the test acts:
  `serve()` finishes every running request `stop` with `serve_tokens`; `fail(error)` makes every running handle
  raise `error` (an engine failure, nothing aborted); `abort(request_id)` does what `on_abort` says:

  - "partial": the handle completes with `abort_tokens`, finish `abort` (an empty `abort_tokens`: no token);
  - "deaf": nothing; the request stays in `running` and its handle never completes (the engine restarted);
  - "raise": the handle raises `ConnectionError` (the engine's worker died).

  `abort` returns whether the engine knew the request (False when "deaf" or when nothing by that id runs).
  `preempt(request)`, where set, is asked at each submit: True, and the engine aborts the request itself at once
  (the handle already holds `abort_tokens`, finish `abort`; it is never in `running`), so the caller resumes it.
  `on_submit(request)`, where set, runs before the request is registered (a close racing the submit).
  Every generated token has log-prob `abort_logprob` in an aborted result, `serve_logprob` in a served one.
- `once_per(key)`: a `preempt` that picks the first request of each `key(request)` (each prompt's, say).
- `threads_left(prefix, within_s)`: the threads named `prefix*` still alive after waiting up to `within_s` for
  them to end (a request that never returns must leave no thread blocked on it).

Records, guarded by `lock`: `requests` (every request submitted, in order), `aborts` (every id `abort` was called
with, "deaf" ones included), `futures` (every handle). `release()` completes the handles still pending, so that no
thread of a failing test stays blocked: call it in the test's `finally`. `wait_running(n)` waits (60 s: a loaded
machine may take seconds to schedule the submitting thread) until `n` requests run and returns their ids, or raises
AssertionError saying how many run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future

from roll_core.interfaces import Request, RequestOutput, SamplingParams

__all__ = ["ON_ABORT", "HeldRequestEngine", "once_per", "threads_left"]

#: What `HeldRequestEngine.abort` can do with a running request.
ON_ABORT = ("partial", "deaf", "raise")


class HeldRequestEngine:
    """The request API of an inference group whose requests run until the test acts on them (see the module's
    docstring). `abort_tokens` / `serve_tokens`: what an aborted / served request generated."""

    def __init__(
        self,
        *,
        abort_tokens: Sequence[int],
        serve_tokens: Sequence[int],
        abort_logprob: float = -0.5,
        serve_logprob: float = -0.25,
        on_abort: str = "partial",
        preempt: Callable[[Request], bool] | None = None,
        on_submit: Callable[[Request], object] | None = None,
    ) -> None:
        self.abort_tokens, self.serve_tokens = list(abort_tokens), list(serve_tokens)
        self.abort_logprob, self.serve_logprob = abort_logprob, serve_logprob
        self.on_abort = on_abort
        self.preempt, self.on_submit = preempt, on_submit
        self.lock = threading.Lock()
        self.running: dict[str, tuple[Request, Future]] = {}
        self.requests: list[Request] = []
        self.aborts: list[str] = []
        self.futures: list[Future] = []  # every handle, to release the abandoned ones at the end

    @property
    def on_abort(self) -> str:
        """What `abort` does with a running request: one of ON_ABORT; a test may change it at any time."""
        return self._on_abort

    @on_abort.setter
    def on_abort(self, mode: str) -> None:
        if mode not in ON_ABORT:
            raise ValueError(f"on_abort={mode!r}: expected one of {', '.join(ON_ABORT)}")
        self._on_abort = mode

    def _aborted(self, request: Request) -> RequestOutput:
        tokens, logprobs = list(self.abort_tokens), [self.abort_logprob] * len(self.abort_tokens)
        return RequestOutput(request.request_id, request.prompt_ids, tokens, logprobs, "abort")

    def submit_request(self, request: Request, route_key: str | None = None, rank: int | None = None) -> Future:
        """Hold `request` in `running` (or preempt it: see `preempt`); its handle completes when the test acts."""
        if self.on_submit is not None:
            self.on_submit(request)
        fut: Future = Future()
        with self.lock:
            self.requests.append(request)
            self.futures.append(fut)
            if self.preempt is not None and self.preempt(request):
                fut.set_result(self._aborted(request))
            else:
                self.running[request.request_id] = (request, fut)
        return fut

    def abort(self, request_id: str) -> bool:
        """Record the abort and act on the request as `on_abort` says; whether the engine knew the request."""
        with self.lock:
            self.aborts.append(request_id)
            if self.on_abort == "deaf":
                return False
            mode = self.on_abort
            item = self.running.pop(request_id, None)
        if item is None:
            return False
        request, fut = item
        if mode == "raise":
            fut.set_exception(ConnectionError("the engine's worker died"))
        else:
            fut.set_result(self._aborted(request))
        return True

    def check_sampling(self, params: SamplingParams) -> None:
        """Every sampling setting is accepted."""
        return None

    def serve(self) -> None:
        """Finish every running request `stop` with `serve_tokens`."""
        with self.lock:
            items, self.running = list(self.running.values()), {}
        tokens = list(self.serve_tokens)
        for request, fut in items:
            if not fut.done():
                logprobs = [self.serve_logprob] * len(tokens)
                fut.set_result(RequestOutput(request.request_id, request.prompt_ids, tokens, logprobs, "stop"))

    def fail(self, error: BaseException) -> None:
        """Every running request raises `error` (an engine failure, nothing aborted)."""
        with self.lock:
            items, self.running = list(self.running.values()), {}
        for _, fut in items:
            fut.set_exception(error)

    def release(self) -> None:
        """Complete every handle still pending (so no thread of a failing test stays blocked)."""
        with self.lock:
            futures = list(self.futures)
        for fut in futures:
            if not fut.done():
                fut.set_result(RequestOutput("x", [], [], [], "abort"))

    def wait_running(self, n: int, timeout_s: float = 60.0) -> list[str]:
        """Wait until at least `n` requests run; their ids, sorted. AssertionError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.running) >= n:
                    return sorted(self.running)
            time.sleep(0.002)
        raise AssertionError(f"{len(self.running)} requests running, expected {n}")


def once_per(key: Callable[[Request], Hashable]) -> Callable[[Request], bool]:
    """A `preempt` that is True for the first request of each `key(request)` and False after (called under the
    engine's lock, so its record needs no lock of its own)."""
    seen: set[Hashable] = set()

    def first(request: Request) -> bool:
        k = key(request)
        if k in seen:
            return False
        seen.add(k)
        return True

    return first


def threads_left(prefix: str, within_s: float) -> list[str]:
    """Wait up to `within_s` for the threads whose name starts with `prefix` to end; the names of those still
    alive (empty: none left)."""
    deadline = time.monotonic() + within_s
    while any(t.name.startswith(prefix) for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]
