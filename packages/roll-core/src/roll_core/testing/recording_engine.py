"""A request engine that records what it is asked and answers at once, for tests of what a caller sends an engine
(the judge's prompts: roll_envs.rewards.judge_backends.EngineBackend). No Ray, no model, no pytest.

`RecordingEngine(reply)`: the request engine API (`submit`, `abort`, `shutdown`, `max_context_length`); `submit`
records the request's prompt ids in `prompts` (in order) and returns a completed future whose output is `reply`
(log-probs 0, finish "stop"); `abort` knows no request.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

__all__ = ["RecordingEngine"]


class RecordingEngine:
    """A request engine that records each prompt's ids and answers `reply` at once."""

    max_context_length = 4096

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
        self.prompts: list[list[int]] = []

    def submit(self, request: Any) -> Future:
        """Record `request.prompt_ids`; a future already holding `reply`, finished "stop"."""
        from roll_core.interfaces import RequestOutput

        self.prompts.append(list(request.prompt_ids))
        fut: Future = Future()
        fut.set_result(
            RequestOutput(request.request_id, request.prompt_ids, self.reply, [0.0] * len(self.reply), "stop")
        )
        return fut

    def abort(self, request_id: str) -> bool:
        """Nothing runs: False."""
        return False

    def shutdown(self) -> None:
        """Nothing to stop."""
