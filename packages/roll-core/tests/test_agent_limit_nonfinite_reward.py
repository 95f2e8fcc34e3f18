"""An agent episode a limit ended (pipeline=agent: the endpoint refused a request past env.max_turns or the context,
HTTP 400) is no failure whatever its program did after the refusal, a returned value that is no finite number (NaN,
a string) included: it scores the reward the program POSTed before, else 0, and stays in eval/n, out of
agent/failed_* (it was an `error` failure: scored env.failure_reward, dropped under on_failure=drop). Without a limit
such a value is still the program's failure.

The collector runs for real behind its OpenAI endpoint, over a scripted engine (roll_core.testing.agent_endpoint);
the program asks until it is refused, POSTs 1.0 on row 0 first, and returns NaN."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.agentic.agent_sessions import AgentSession, SessionLimits
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors.agents import _outcome
from roll_core.pipelines.metrics import StepLog
from roll_core.testing.agent_endpoint import ScriptedTextEngine

FAILURE_REWARD = -0.5


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


class _AsksUntilRefused:
    """An agent-program task (two turns at most) whose program asks until the endpoint refuses (HTTP 400 past
    max_turns), POSTs the reward 1.0 first on row 0, and returns NaN; `refusals`: the HTTP codes it was refused
    with."""

    is_agent_program = True
    name = "asks_until_refused"
    max_turns, max_tokens_per_turn, max_context_length = 2, 4, 256
    episode_timeout_s = 30.0
    tool_parser, on_rewrite = "none", "restart"
    failure_reward, success_reward, model_name = FAILURE_REWARD, 1.0, "roll"

    def __init__(self, on_failure: str) -> None:
        self.on_failure = on_failure
        self.chat_template_kwargs: dict[str, Any] = {}
        self.refusals: list[int] = []

    def train_rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        return [{"id": i % 2} for i in range(count)]

    def eval_rows(self) -> list[dict[str, Any]]:
        return [{"id": 0}, {"id": 1}]

    def run_episode(self, base_url: str, reward_url: str, row: dict[str, Any]) -> float | None:
        if row["id"] == 0:
            _post(reward_url, {"reward": 1.0})
        for _ in range(self.max_turns + 1):
            try:
                _post(f"{base_url}/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "go"}]})
            except urllib.error.HTTPError as exc:
                self.refusals.append(exc.code)
                break
        return float("nan")


def _collector(task: _AsksUntilRefused) -> Any:
    from roll_core.pipelines.collectors import CollectorContext
    from roll_core.pipelines.collectors.agents import agent_collectors

    tok = build_tiny_tokenizer()
    pipe = SimpleNamespace(
        seed=0, rollout_batch_size=2, async_ratio=0, eval_temperature=0.0, async_abort_timeout_s=60.0, max_idle_aborts=8
    )
    cfg = SimpleNamespace(pipeline=pipe, algo=SimpleNamespace(group_size=2), model=SimpleNamespace())
    cfg.model.chat_template_kwargs = {}
    engine = ScriptedTextEngine(tok, ["ok"] * 64)
    ctx = CollectorContext(cfg, None, engine, SamplingParams(max_new_tokens=4), tok, task, "tiny")
    agent_collectors.check(cfg, task)
    return agent_collectors(ctx)


@pytest.mark.parametrize("on_failure", ["score", "drop"])
def test_a_limited_episode_returning_nan_is_scored_not_failed(
    on_failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Evaluation: row 0 (POSTed 1.0) succeeds, row 1 scores 0: eval/accuracy 0.5 over eval/n 2, no failure (old:
    eval/failed_error 2, eval/accuracy 0.0, every reward env.failure_reward -0.5). Training, 4 episodes: reward/mean
    0.5, all 4 trained under either on_failure (old: 4 failures; under drop all 4 dropped, no reward/mean)."""
    task = _AsksUntilRefused(on_failure)
    collector = _collector(task)
    try:
        with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.collectors.agents"):
            m = collector.evaluate(1)
        out = StepLog()
        collected = collector.next(1, out)
    finally:
        collector.close()
    assert task.refusals == [400] * 6  # every episode ended at the max_turns refusal
    assert (m["eval/n"], m["eval/accuracy"], m["eval/failed_episodes"], m["eval/failed_error"]) == (2.0, 0.5, 0.0, 0.0)
    assert m["eval/end_max_turns"] == 1.0
    assert "ended at its max_turns limit; the program returned nan, not a finite number: scored 1" in caplog.text
    assert "failed (error)" not in caplog.text
    assert out["agent/failed_episodes"] == 0.0 and out["reward/mean"] == 0.5
    assert out["data/dropped_episodes"] == 0 and out["data/failure_dropped_episodes"] == 0
    assert sorted(collected.scores.tolist()) == [0.0, 0.0, 1.0, 1.0]


def _limited(end: str) -> AgentSession:
    session = AgentSession("s", SamplingParams(), SessionLimits(), template=None)
    session.traj.end = end
    return session


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", None])
def test_what_a_limited_program_returns_is_never_its_failure(value: Any) -> None:
    """At a limit, a returned value that is no finite number scores the reward POSTed before (0.5), else 0; without a
    limit it stays an `error` failure (None: `no_reward`)."""
    limited = _limited("max_context")
    reward, failure, _ = _outcome({"reward": value}, limited, timed_out=False)
    assert (reward, failure) == (0.0, None)
    limited.reward = 0.5
    assert _outcome({"reward": value}, limited, timed_out=False)[:2] == (0.5, None)
    unlimited = _limited("")
    want = "no_reward" if value is None else "error"
    assert _outcome({"reward": value}, unlimited, timed_out=False)[:2] == (0.0, want)
    assert _outcome({"reward": 0.25}, _limited("max_turns"), timed_out=False) == (0.25, None, "")
