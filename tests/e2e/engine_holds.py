"""Holding an in-process hf engine at a step boundary, for tests that must act while requests are under way.

Polling an engine for "a request has generated k tokens" races the engine on a loaded machine: the tiny model can
finish a whole response between two polls of the test's thread, and the state the test waits for is gone (CI,
2026-12-04: tests/e2e/test_partial_gpu_rollout.py and test_agentic_async.py each failed that way once).
`EngineHold(engine, tokens)` instead pauses the engine itself, exactly as a weight update pauses it, after the first
step that leaves one of its running requests with at least `tokens` generated tokens; the test then finds those
requests running for as long as it needs. `release()` lets the engine step again (or the test ends the pause with
`engine.finish_weight_update()`, as a weight sync would).
"""

from __future__ import annotations

import threading
from typing import Any


class EngineHold:
    """Pause `engine` (a roll_engines.infer.hf.HFInferEngine) once `count` running requests have `tokens` tokens."""

    def __init__(self, engine: Any, tokens: int, count: int = 1) -> None:
        self.engine, self.reached = engine, threading.Event()
        step = engine._step

        def held() -> None:  # the engine thread, under the engine's lock
            step()
            if not self.reached.is_set() and len(self.running(tokens)) >= count:
                engine._paused = True
                self.reached.set()

        engine._step = held

    def running(self, tokens: int) -> list[Any]:
        """The engine's unfinished running requests with at least `tokens` generated tokens."""
        return [s for s in self.engine.batcher.running if len(s.tokens) >= tokens and s.finish is None]

    def wait(self, what: str, timeout: float = 120.0) -> None:
        """Block until the engine is held (an AssertionError naming `what` after `timeout` seconds)."""
        assert self.reached.wait(timeout), f"timed out waiting for {what}"

    def release(self) -> None:
        """Let the engine step again."""
        with self.engine._lock:
            self.engine._paused = False
            self.engine._work.notify_all()
