"""Env managers: many environment instances stepped concurrently, each call under a timeout.

Contract: `reset(slot, seed)` and `step(slot, action)` run the slot's environment on a worker thread and return its
result, or raise `EnvFailure` with kind `env_error` (it raised, or returned a malformed result, as
roll_core.agentic.step_values checks it for the third-party adapters too: a reset that is not a 2-tuple
(observation, info dict or None), a step that is not Gymnasium's 5 values, a reward that is not a finite real
number, a terminated/truncated flag or an info's "success"/"invalid_action" that is not a bool or 0/1, an info that
is not a dict or None, an observation None but on the step that ends the episode (there it is ""), an info count
(`tool_calls`, roll_core.interfaces.agentic.INFO_COUNTERS) that is not a whole number >= 0; NumPy scalars are
read) or `env_timeout` (it did not answer within `step_timeout_s` of starting). At most `threads` calls run at
once; a call that times out gives its place back at once, so a hung environment never delays (or times out) the calls of
healthy ones. A failed slot gets a fresh environment instance; a hung one keeps its thread (Python threads
cannot be killed): it is a daemon thread, so it never blocks the process from exiting, and it is counted in
`leaked_threads`. One broken episode never stops the others or the run. Counters (`counters()`) feed the run's metrics.

Environments are closed: an instance's `close()`, where it has one (optional in roll_core.interfaces.Env), is
called when its slot drops it (it failed: at once, or for a hung call when that call returns, never while it runs)
and for every instance at `close()`. A close that raises or hangs (past `step_timeout_s`) is logged and counted in
`env_close_errors` (a hung one also in `leaked_threads`), never raised: a failed call's own error stays the one
reported.

Observations are returned in normal form (roll_core.agentic.observation): text, or `{"text", "images"}` with RGB
PIL pictures; a malformed observation (or a picture that does not load) fails its episode as an `env_error`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from roll_core.agentic.observation import Observation, normalize
from roll_core.agentic.step_values import checked_reset, checked_step
from roll_core.interfaces import Env
from roll_core.interfaces.agentic import INFO_COUNTERS, info_count

log = logging.getLogger(__name__)


class EnvFailure(RuntimeError):
    """An environment raised or hung; `kind` is `env_error` or `env_timeout`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class EnvManager:
    """`slots` environments built by `factory`, at most `threads` calls at once, each under a timeout."""

    def __init__(self, factory: Callable[[], Env], slots: int, *, step_timeout_s: float = 30.0, threads: int = 16):
        self.factory, self.timeout = factory, step_timeout_s
        # A slot whose environment failed holds None until its next reset builds a new one (inside that call: a
        # factory that raises or hangs then fails that episode, counted, instead of the whole rollout).
        self.envs: list[Env | None] = [factory() for _ in range(slots)]
        # Why not a ThreadPoolExecutor: a hung call would hold one of its workers for good, and calls queued behind
        # it would spend their timeout waiting for a worker, failing healthy environments (the bug this replaced).
        self._slots = threading.BoundedSemaphore(max(1, threads))
        self._lock = threading.Lock()
        self._counts = {"env_errors": 0, "env_timeouts": 0, "leaked_threads": 0, "env_close_errors": 0}
        self._closed = False

    @classmethod
    def for_task(cls, task: Any) -> EnvManager:
        """An empty manager over an agentic task's environments, with its step timeout and thread count."""
        return cls(task.make_env, 0, step_timeout_s=task.step_timeout_s, threads=task.env_threads)

    def grow(self, slots: int) -> None:
        """Make sure at least `slots` environments exist."""
        while len(self.envs) < slots:
            self.envs.append(self.factory())

    def _call(self, slot: int, what: str, fn: Callable[[], Any], used: list[Env]) -> Any:
        """`fn()` on a thread under the timeout. `used`: the instances the call works on (`fn` may add the one it
        builds), closed when the call fails: at once when it raised, when it returns when it hung."""
        if self._closed:
            raise RuntimeError("EnvManager is closed")
        future: Future[Any] = Future()
        # Who closes the instances of a call that timed out: its own thread once fn returns (closing them while
        # the call still runs in them could break it worse), or the caller if fn returned just after the timeout.
        late = {"returned": False, "abandoned": False}
        late_lock = threading.Lock()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, which decides
                future.set_exception(exc)
            with late_lock:
                late["returned"] = True
                close_here = late["abandoned"]
            if close_here:
                self._close(used, f"after its {what} that timed out returned")

        with self._slots:  # the clock starts when the call runs, not while it waits for a place
            threading.Thread(target=run, name=f"roll-env-{slot}-{what}", daemon=True).start()
            done = bool(wait([future], timeout=self.timeout).done)
        if not done:
            self._fail(slot, "env_timeout", "leaked_threads")
            log.warning("environment %s did not return within %ss (episode ended, counted)", what, self.timeout)
            with late_lock:
                late["abandoned"] = True
                close_now = late["returned"]
            if close_now:
                self._close(used, f"after its {what} timed out")
            raise EnvFailure("env_timeout", f"environment {what} did not return within {self.timeout}s")
        exc = future.exception()
        if exc is not None:
            self._fail(slot, "env_error")
            log.warning("environment %s raised %s: %s (episode ended, counted)", what, type(exc).__name__, exc)
            self._close(used, f"after its {what} failed")
            raise EnvFailure("env_error", f"environment {what} raised {type(exc).__name__}: {exc}") from exc
        return future.result()

    def _fail(self, slot: int, kind: str, extra: str | None = None) -> None:
        self._count("env_errors" if kind == "env_error" else "env_timeouts", *([extra] if extra else []))
        self.envs[slot] = None  # the broken instance may hold bad state (or still run in its thread)

    def _close(self, envs: list[Any], why: str) -> None:
        """`close()` of each of `envs` that has one, all at once on daemon threads (outside the `threads` places:
        hung calls must not keep instances open), waiting at most the step timeout in all. One that raises or
        hangs is logged and counted (module docstring), never raised."""
        futures: list[tuple[Any, Future[None]]] = []
        for env in envs:
            close = getattr(env, "close", None)
            if not callable(close):
                continue
            future: Future[None] = Future()

            def run(close: Callable[[], Any] = close, future: Future[None] = future) -> None:
                try:
                    close()
                    future.set_result(None)
                except BaseException as exc:
                    future.set_exception(exc)

            threading.Thread(target=run, name="roll-env-close", daemon=True).start()
            futures.append((env, future))
        if not futures:
            return
        wait([f for _, f in futures], timeout=self.timeout)
        for env, future in futures:
            name = type(env).__name__
            if not future.done():
                self._count("env_close_errors", "leaked_threads")
                log.warning("%s.close() (%s) did not return within %ss (counted)", name, why, self.timeout)
            elif (exc := future.exception()) is not None:
                self._count("env_close_errors")
                log.warning("%s.close() (%s) raised %s: %s (counted)", name, why, type(exc).__name__, exc)

    def _count(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self._counts[key] += 1

    # The results are checked inside the call: an environment that returns the wrong shape, a reward that is not a
    # number, or NaN, fails its episode as an env_error like one that raises, instead of the whole rollout.
    def reset(self, slot: int, seed: int) -> tuple[Observation, dict[str, Any]]:
        current = self.envs[slot]
        used = [] if current is None else [current]

        def reset() -> tuple[Env, Observation, dict[str, Any]]:
            # A slot that failed before gets a fresh instance, built under this call's timeout.
            if current is None:
                used.append(self.factory())
            env = used[0]
            obs, info = checked_reset(env.reset(seed=seed))
            return env, normalize(obs), info

        # Installed by this thread once the call answered in time: a build that timed out must not land in the
        # slot later, reset with its own episode's seed, under the next episode (which would step it unawares).
        env, obs, info = self._call(slot, "reset", reset, used)
        self.envs[slot] = env
        return obs, info

    def step(self, slot: int, action: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        env = self.envs[slot]

        def step() -> tuple[Observation, float, bool, bool, dict[str, Any]]:
            if env is None:
                raise RuntimeError("the environment failed earlier in this episode; reset it first")
            obs, reward, terminated, truncated, info = checked_step(env.step(action))
            for key in ("tool_calls", *INFO_COUNTERS):  # summed per episode: a bad count is a wrong metric
                info_count(info, key)
            return normalize(obs), reward, terminated, truncated, info

        return self._call(slot, "step", step, [] if env is None else [env])

    def bad_observation(self, slot: int, error: Exception) -> EnvFailure:
        """The `env_error` of an observation that passed the call's checks but that the chat template could not
        encode (pictures for a text model): counted, the slot's environment replaced, as for one the call
        refused."""
        env = self.envs[slot]
        self._fail(slot, "env_error")
        log.warning("an observation could not be encoded: %s (episode ended, counted)", error)
        self._close([env], "after its observation could not be encoded")
        return EnvFailure("env_error", f"the observation could not be encoded: {error}")

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Refuse further calls and close every instance (module docstring); a second close does nothing. Call it
        when the episodes are over: an instance whose call still runs is closed under it."""
        self._closed = True
        envs, self.envs = [e for e in self.envs if e is not None], [None] * len(self.envs)
        self._close(envs, "the env manager closed")
