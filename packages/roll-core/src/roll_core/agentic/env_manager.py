"""Env managers: many environment instances stepped concurrently, each call under a timeout.

Contract: `reset(slot, seed)` and `step(slot, action)` run the slot's environment on a worker thread and return its
result, or raise `EnvFailure` with kind `env_error` (it raised, or returned a malformed result or a non-finite
reward) or `env_timeout` (it did not answer within `step_timeout_s` of starting). At most `threads` calls run at
once; a call that times out gives its place back at once, so a hung environment never delays (or times out) the
calls of healthy ones. A failed slot gets a fresh environment instance; a hung one keeps its thread (Python threads
cannot be killed): it is a daemon thread, so it never blocks the process from exiting, and it is counted in
`leaked_threads`. One broken episode never stops the others or the run. Counters (`counters()`) feed the run's metrics.

Observations are returned in normal form (roll_core.agentic.observation): text, or `{"text", "images"}` with RGB
PIL pictures; a malformed observation (or a picture that does not load) fails its episode as an `env_error`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from roll_core.agentic.observation import Observation, normalize
from roll_core.interfaces import Env

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
        self._counts = {"env_errors": 0, "env_timeouts": 0, "leaked_threads": 0}
        self._closed = False

    @classmethod
    def for_task(cls, task: Any) -> EnvManager:
        """An empty manager over an agentic task's environments, with its step timeout and thread count."""
        return cls(task.make_env, 0, step_timeout_s=task.step_timeout_s, threads=task.env_threads)

    def grow(self, slots: int) -> None:
        """Make sure at least `slots` environments exist."""
        while len(self.envs) < slots:
            self.envs.append(self.factory())

    def _call(self, slot: int, what: str, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise RuntimeError("EnvManager is closed")
        future: Future[Any] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, which decides
                future.set_exception(exc)

        with self._slots:  # the clock starts when the call runs, not while it waits for a place
            threading.Thread(target=run, name=f"roll-env-{slot}-{what}", daemon=True).start()
            done = bool(wait([future], timeout=self.timeout).done)
        if not done:
            self._fail(slot, "env_timeout", "leaked_threads")
            log.warning("environment %s did not return within %ss (episode ended, counted)", what, self.timeout)
            raise EnvFailure("env_timeout", f"environment {what} did not return within {self.timeout}s")
        exc = future.exception()
        if exc is not None:
            self._fail(slot, "env_error")
            log.warning("environment %s raised %s: %s (episode ended, counted)", what, type(exc).__name__, exc)
            raise EnvFailure("env_error", f"environment {what} raised {type(exc).__name__}: {exc}") from exc
        return future.result()

    def _fail(self, slot: int, kind: str, extra: str | None = None) -> None:
        with self._lock:
            self._counts["env_errors" if kind == "env_error" else "env_timeouts"] += 1
            if extra:
                self._counts[extra] += 1
        self.envs[slot] = None  # the broken instance may hold bad state (or still run in its thread)

    # The results are checked inside the call: an environment that returns the wrong shape, a reward that is not a
    # number, or NaN, fails its episode as an env_error like one that raises, instead of the whole rollout.
    def reset(self, slot: int, seed: int) -> tuple[Observation, dict[str, Any]]:
        current = self.envs[slot]

        def reset() -> tuple[Env, Observation, dict[str, Any]]:
            # A slot that failed before gets a fresh instance, built under this call's timeout.
            env = current if current is not None else self.factory()
            obs, info = env.reset(seed=seed)
            return env, normalize(obs), dict(info or {})

        # Installed by this thread once the call answered in time: a build that timed out must not land in the
        # slot later, reset with its own episode's seed, under the next episode (which would step it unawares).
        env, obs, info = self._call(slot, "reset", reset)
        self.envs[slot] = env
        return obs, info

    def step(self, slot: int, action: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        env = self.envs[slot]

        def step() -> tuple[Observation, float, bool, bool, dict[str, Any]]:
            if env is None:
                raise RuntimeError("the environment failed earlier in this episode; reset it first")
            obs, reward, terminated, truncated, info = env.step(action)
            if not math.isfinite(float(reward)):
                raise ValueError(f"step returned the reward {reward!r}; rewards must be finite numbers")
            return normalize(obs), float(reward), bool(terminated), bool(truncated), dict(info or {})

        return self._call(slot, "step", step)

    def bad_observation(self, slot: int, error: Exception) -> EnvFailure:
        """The `env_error` of an observation that passed the call's checks but that the chat template could not
        encode (a picture placeholder spelt in its text): counted, the slot's environment replaced, as for one
        the call refused."""
        self._fail(slot, "env_error")
        log.warning("an observation could not be encoded: %s (episode ended, counted)", error)
        return EnvFailure("env_error", f"the observation could not be encoded: {error}")

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        self._closed = True
