"""`RunningServer.stop` (roll_envs.rewards.serve) with a request in flight, against a real server on 127.0.0.1:
a score that runs long must not keep the server's thread alive past stop's wait."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="pip install 'roll-envs[remote]'")

from roll_envs.rewards.serve import serve_in_thread


class _Stuck:
    """A reward whose score runs until the test releases it (a slow verifier: 30 s, a minute...)."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def score(self, responses: list[str], answers: list[str]) -> Any:
        from roll_core.interfaces import RewardResult

        self.started.set()
        self.release.wait(120)
        ones = [1.0] * len(responses)
        return RewardResult(scores=ones, correct=ones, formatted=ones)


def test_stop_cuts_off_a_slow_request_and_its_thread_ends() -> None:
    """stop() waited 10 s for the server's thread while aiohttp's cleanup waited up to 60 s (twice) for the slow
    request: stop returned with the thread still serving. Now a request in flight gets STOP_GRACE_S, then its
    connection is closed, and the thread ends within stop's wait."""
    reward = _Stuck()
    served = serve_in_thread(reward)
    outcome: dict[str, Any] = {}

    def client() -> None:
        body = json.dumps({"rows": [{"response": "a", "answer": "b"}]}).encode()
        request = urllib.request.Request(served.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                outcome["status"] = reply.status
        except Exception as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=client, name="slow-client")
    caller.start()
    try:
        assert reward.started.wait(60), "the request never reached the reward"
        t0 = time.perf_counter()
        served.stop()
        took = time.perf_counter() - t0
        assert not served._thread.is_alive(), f"the server thread still runs {took:.1f} s after stop"
        assert took < 20  # the grace (STOP_GRACE_S, 5 s) and the cleanup
        caller.join(60)
        assert "error" in outcome and "status" not in outcome  # cut off, never answered
    finally:
        reward.release.set()
        caller.join(60)
