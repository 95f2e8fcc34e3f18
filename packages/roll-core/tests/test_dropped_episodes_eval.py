"""`env.on_failure=drop` means one thing in both episode pipelines (`pipeline=agentic`, `pipeline=agent`):

- training leaves an episode its environment (or agent program) failed out of the batch and out of the reward and
  episode metrics, which describe what was trained; data/dropped_episodes counts it;
- evaluation drops nothing: such a held-out episode is an unsuccessful attempt (scored `env.failure_reward`, in
  eval/n and eval/accuracy), counted in eval/dropped_episodes with a warning. Left out, 3 environment timeouts and 1
  success read eval/accuracy 1.0 on eval/n 1 (a timeout is often the policy's doing: a program it ran hung);
- a training step whose every episode was left out logs no reward/mean (it read 0.0, a mean over no episode);
- roll-eval, when every held-out episode failed in its environment, reports a rate of 0 with a warning naming the
  failures (it refused with "every episode(s) were refused by the inference engine").

The agentic episodes run for real (AgenticRollout, EnvManager) against a scripted environment and engine: seed 0
wins on its first reply, seed 1's step raises (env_error), seeds 2 and up hang past the step timeout (env_timeout).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
from roll_core.agentic.trajectory import Trajectory
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors.agents import AgentCollector, Episode
from roll_core.pipelines.collectors.episodes import EpisodeCollector
from roll_core.pipelines.metrics import StepLog
from roll_core.testing.agent_endpoint import ScriptedTextEngine

FAILURE_REWARD = -0.5
_CFG = SimpleNamespace(
    pipeline=SimpleNamespace(eval_temperature=0.0, seed=1, rollout_batch_size=2),
    algo=SimpleNamespace(group_size=2),
)


class _Scripted:
    """Seed 0: the first reply wins (reward 1, success). Seed 1: the step raises. Seeds 2 and up: the step hangs
    until `release` is set (the test's teardown sets it; at most 30 s), past the step timeout."""

    release = threading.Event()

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = seed
        return f"board {seed}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.seed == 1:
            raise RuntimeError("the tool crashed")
        if self.seed is not None and self.seed >= 2:
            self.release.wait(30.0)
        return "won", 1.0, True, False, {"success": True}


@pytest.fixture(autouse=True)
def _release_hung_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_Scripted, "release", threading.Event())
    yield
    _Scripted.release.set()


def _agentic(seeds: list[int], on_failure: str) -> EpisodeCollector:
    """An episodes collector whose held-out seeds are `seeds`, over the scripted environment and engine."""
    tok = build_tiny_tokenizer()
    c = EpisodeCollector.__new__(EpisodeCollector)
    c.cfg, c.sampling, c._counters = _CFG, SamplingParams(max_new_tokens=8), {}
    c.task = SimpleNamespace(on_failure=on_failure, failure_reward=FAILURE_REWARD)
    c.ctx = SimpleNamespace(samples=lambda step, rows: None)
    c.tokenizer = tok
    c.envs = EnvManager(_Scripted, 0, step_timeout_s=0.5, threads=8)
    engine = ScriptedTextEngine(tok, ["go"] * 64)
    c.rollout = AgenticRollout(engine, c.envs, TurnTemplate(tok, "Play."), tok, EpisodeLimits(2, 2048, 8))
    c.eval_seeds = seeds
    return c


def test_evaluation_counts_dropped_environment_failures_as_unsuccessful_attempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """3 timeouts (seeds 2-4) and 1 success (seed 0) under on_failure=drop: a success rate of 0.25 over 4 episodes.
    Old: eval/accuracy 1.0 and eval/reward 1.0 on eval/n 1, the timeouts only in eval/end_env_timeout 0.75."""
    c = _agentic([0, 2, 3, 4], "drop")
    try:
        with caplog.at_level("WARNING", logger="roll_core.pipelines.collectors.episodes"):
            m = c.evaluate(1)
    finally:
        c.envs.close()
    assert m["eval/end_env_timeout"] == 0.75 and m["eval/end_terminated"] == 0.25
    assert m["eval/n"] == 4.0  # old: 1.0
    assert m["eval/accuracy"] == 0.25 and m["eval/success_rate"] == 0.25  # old: 1.0
    assert m["eval/reward"] == pytest.approx((1.0 + 3 * FAILURE_REWARD) / 4)  # scored failure_reward; old: 1.0
    assert (m["eval/failed_episodes"], m["eval/dropped_episodes"], m["eval/aborted_episodes"]) == (3.0, 3.0, 0.0)
    assert "3 of 4 held-out episode(s) ended in an environment failure" in caplog.text
    assert "eval/dropped_episodes" in caplog.text


def test_evaluation_under_score_is_the_same_and_drops_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """The rule holds whatever on_failure says: the same numbers under `score`, nothing dropped, no warning."""
    c = _agentic([0, 1, 2], "score")
    try:
        with caplog.at_level("WARNING", logger="roll_core.pipelines.collectors.episodes"):
            m = c.evaluate(1)
    finally:
        c.envs.close()
    assert (m["eval/n"], m["eval/accuracy"]) == (3.0, pytest.approx(1 / 3))
    assert m["eval/reward"] == pytest.approx((1.0 + 2 * FAILURE_REWARD) / 3)
    assert (m["eval/failed_episodes"], m["eval/dropped_episodes"]) == (2.0, 0.0)
    assert "held-out episode(s) ended in an environment failure" not in caplog.text


def test_roll_eval_reports_every_held_out_episode_failing_as_the_environments_not_the_engines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every held-out episode failed (1 env_error, 2 env_timeout) under drop: roll-eval reports a success rate of 0
    on 3 episodes and warns naming the environment's failures. Old: ConfigError "every episode(s) were refused by
    the inference engine" (the collector reported eval/n 0)."""
    from roll_core.evaluate import episode_result

    c = _agentic([1, 2, 3], "drop")
    try:
        with caplog.at_level("WARNING"):
            r = episode_result(c.evaluate(0), "scripted", agentic=True)
    finally:
        c.envs.close()
    assert (r["n"], r["success_rate"], r["accuracy"]) == (3, 0.0, 0.0)
    assert (r["failed_episodes"], r["dropped_episodes"], r["aborted_episodes"]) == (3, 3, 0)
    assert r["ends"] == {"env_error": pytest.approx(1 / 3), "env_timeout": pytest.approx(2 / 3)}
    assert "every one of the 3 held-out episode(s) of scripted ended in a failure of its environment" in caplog.text
    assert "(2 env_timeout, 1 env_error)" in caplog.text
    assert "inference engine" not in caplog.text


def test_an_agentic_training_step_that_dropped_every_episode_logs_no_reward() -> None:
    """Training under drop: the failed episodes are out of the batch and the reward metrics, counted in
    data/dropped_episodes; with every episode dropped there is no reward/mean (old: 0.0) nor success rate, while
    the end reasons and the environment counters are still logged."""
    c = _agentic([], "drop")
    try:
        trajs = c.rollout.run([0, 2, 1, 1], [0, 0, 1, 1], SamplingParams(max_new_tokens=8))
        out = StepLog()
        collected = c.collected(1, trajs, out)
        assert len(collected.batch) == 1 and collected.scores.tolist() == [1.0]
        assert out["reward/mean"] == 1.0 and out["episode/success_rate"] == 1.0
        assert out["data/dropped_episodes"] == 3 and out["episode/end_env_error"] == 0.5
        none_left = StepLog()
        assert c.collected(2, c.rollout.run([1, 2], [0, 0], SamplingParams(max_new_tokens=8)), none_left) is None
    finally:
        c.envs.close()
    assert none_left["data/dropped_episodes"] == 2
    assert none_left["episode/end_env_error"] == 0.5 and none_left["episode/end_env_timeout"] == 0.5
    assert none_left["env/env_errors"] == 1.0 and none_left["env/env_timeouts"] == 1.0
    assert "reward/mean" not in none_left  # old: 0.0
    assert not any(k.startswith("reward/") or k == "episode/success_rate" for k in none_left), sorted(none_left)


# ---- pipeline=agent ------------------------------------------------------------------------------------------


def _traj(i: int, success: bool, end: str = "terminated") -> Trajectory:
    t = Trajectory(env_seed=i, group=i // 2, prompt_ids=[1, 2], end=end, success=success)
    t.add_response([5, 6], [-0.1] * 2)
    t.turn_rewards.append(1.0 if success else FAILURE_REWARD)
    t.state_keys.append(f"s{i}")
    return t


def _agent_episodes(outcomes: list[str | None]) -> list[Episode]:
    """Agent-program episodes: None succeeded (reward 1), a failure kind ("timeout", "error") failed (reward
    failure_reward, end env_timeout / env_error), as `AgentCollector.episode` leaves them."""
    counters = dict.fromkeys(
        ("requests", "engine_errors", "rewrites", "replays", "dropped_turns", "invalid_tool_calls"), 1
    )
    session = SimpleNamespace(**counters, constrained_turns=0, resumed=0)
    ends = {None: "terminated", "timeout": "env_timeout", "error": "env_error"}
    return [
        Episode(
            {"row": i},
            _traj(i, failure is None, ends[failure]),
            1.0 if failure is None else FAILURE_REWARD,
            failure,
            session,  # type: ignore[arg-type]
        )
        for i, failure in enumerate(outcomes)
    ]


def _agent(outcomes: list[str | None], on_failure: str) -> AgentCollector:
    c = AgentCollector.__new__(AgentCollector)
    c.cfg, c.tokenizer = _CFG, build_tiny_tokenizer()
    c.ctx = SimpleNamespace(sampling=SamplingParams(max_new_tokens=4), samples=lambda step, rows: None)
    c.task = SimpleNamespace(
        on_failure=on_failure,
        eval_rows=lambda: [{"row": i} for i in range(len(outcomes))],
        train_rows=lambda count, seed: [{"row": i} for i in range(count)],
    )
    c.sessions = SimpleNamespace(gate=SimpleNamespace(stats=dict))
    episodes = _agent_episodes(outcomes)
    c.run = lambda runs, params: episodes  # type: ignore[method-assign]
    return c


def test_agent_training_under_drop_keeps_failed_episodes_out_of_the_reward_metrics() -> None:
    """As pipeline=agentic: 1 success and 3 failures under drop train the success alone, and the metrics describe
    it (reward/mean 1.0; old: (1 - 1.5) / 4 = -0.125, success rate 0.25); every episode failed: no reward/mean."""
    out = StepLog()
    collected = _agent([None, "timeout", "timeout", "error"], "drop").next(1, out)
    assert len(collected.batch) == 1 and out["data/dropped_episodes"] == 3
    assert out["reward/mean"] == 1.0 and out["episode/success_rate"] == 1.0  # old: -0.125, 0.25
    assert out["agent/failed_episodes"] == 3.0 and out["agent/failed_timeout"] == 2.0  # still counted
    assert out["episode/end_env_timeout"] == 0.5
    none_left = StepLog()
    assert _agent(["timeout", "error", "error", "timeout"], "drop").next(2, none_left) is None
    assert none_left["data/dropped_episodes"] == 4 and none_left["agent/failed_episodes"] == 4.0
    assert "reward/mean" not in none_left and "episode/success_rate" not in none_left  # old: -0.5, 0.0
    scored = StepLog()  # under score the failures are trained, and in the metrics, with their failure reward
    _agent([None, "timeout", "timeout", "error"], "score").next(1, scored)
    assert (
        scored["reward/mean"] == pytest.approx((1.0 + 3 * FAILURE_REWARD) / 4) and scored["data/dropped_episodes"] == 0
    )


def test_agent_evaluation_counts_dropped_failures_as_unsuccessful_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """pipeline=agent's evaluation under drop: the 3 failed of 4 are in eval/n and eval/accuracy, counted in
    eval/dropped_episodes (old: absent) with a warning."""
    with caplog.at_level("WARNING", logger="roll_core.pipelines.collectors.episodes"):
        m = _agent([None, "timeout", "timeout", "error"], "drop").evaluate(1)
    assert (m["eval/n"], m["eval/accuracy"], m["eval/failed_episodes"]) == (4.0, 0.25, 3.0)
    assert m["eval/reward"] == pytest.approx((1.0 + 3 * FAILURE_REWARD) / 4)
    assert m["eval/dropped_episodes"] == 3.0
    assert "3 of 4 held-out episode(s) failed" in caplog.text
    assert _agent([None, "timeout"], "score").evaluate(1)["eval/dropped_episodes"] == 0.0
