"""The episode collectors and aborted work: an agentic episode the rollout kept `untrained` (a turn the engine kept
refusing cut it) is neither trained nor counted in the reward metrics, and an agent episode that timed out with a
request in flight is labelled a timeout, not an abort."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from roll_core.agentic.trajectory import Trajectory
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors.episodes import EpisodeCollector
from roll_core.pipelines.metrics import StepLog


def _traj(group: int, rewards: list[float], *, success: bool = False, end: str = "terminated") -> Trajectory:
    t = Trajectory(env_seed=group, group=group, prompt_ids=[1, 2], end=end, success=success)
    for r in rewards:
        t.add_response([5, 6, 7], [-0.1] * 3)
        t.turn_rewards.append(r)
        t.state_keys.append(f"s{len(t.turn_rewards)}")
        t.add_observation([3])
    return t


def _episodes() -> EpisodeCollector:
    c = EpisodeCollector.__new__(EpisodeCollector)  # the batch-building part only
    c.task, c.tokenizer, c._counters = SimpleNamespace(on_failure="score"), build_tiny_tokenizer(), {}
    c.envs = SimpleNamespace(counters=dict)
    c.ctx = SimpleNamespace(samples=lambda step, rows: None)
    return c


def test_an_untrained_episode_is_left_out_of_the_batch_and_the_reward_metrics() -> None:
    """A group of four: a success (reward 1), a failure (0), and two episodes an engine refusal cut (`untrained`,
    end `abort`): one after a turn worth 0.5, one before any turn. Only the first two are trained, and they alone
    make the rewards (0.5, not 0.375 with the cut episode's partial reward and 0.25 success with both cut ones)."""
    cut = _traj(0, [0.5], end="abort")
    cut.untrained = True
    empty = Trajectory(env_seed=0, group=0, prompt_ids=[], end="abort", untrained=True)
    trajs = [_traj(0, [0.0, 1.0], success=True), _traj(0, [0.0, 0.0], end="max_turns"), cut, empty]
    out = StepLog()
    collected = _episodes().collected(1, trajs, out)
    assert len(collected.batch) == 2 and collected.scores.tolist() == [1.0, 0.0]
    assert out["data/dropped_episodes"] == 2 and out["data/aborted_episodes"] == 2
    assert out["reward/mean"] == 0.5 and out["episode/success_rate"] == 0.5 and out["reward/accuracy"] == 0.5
    assert out["reward/std"] == 0.5**0.5 and out["episode/turns_mean"] == 2.0
    assert out["episode/end_abort"] == 0.5 and out["episode/end_terminated"] == 0.25  # end reasons: all episodes
    every_aborted = StepLog()
    assert _episodes().collected(2, [cut, empty], every_aborted) is None
    # no episode with an outcome: no reward/mean at all (it read 0.0, a mean over none)
    assert every_aborted["data/dropped_episodes"] == 2 and "reward/mean" not in every_aborted


class _Hanging:
    """The request API: the first turn of a session answers "ok"; later ones hang until aborted (then 'abort' with
    one token of partial output)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.hung, self.served = tokenizer, {}, 0
        self.waiting = threading.Event()

    def submit_request(self, request: Any, route_key: str | None = None) -> Future:
        from roll_core.interfaces import RequestOutput

        fut: Future = Future()
        if self.served == 0:
            self.served += 1
            ids = self.tokenizer("ok", add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.5] * len(ids), "stop"))
        else:
            self.hung[request.request_id] = (request, fut)
            self.waiting.set()
        return fut

    def abort(self, request_id: str) -> bool:
        from roll_core.interfaces import RequestOutput

        if request_id not in self.hung:
            return False
        request, fut = self.hung.pop(request_id)
        fut.set_result(RequestOutput(request_id, request.prompt_ids, [7], [-0.5], "abort"))
        return True


def test_an_agent_episode_that_times_out_mid_request_ends_env_timeout_not_abort() -> None:
    """Closing a timed-out session aborts its request in flight, which marked the trajectory `abort`; `finish`
    keeps an earlier end, so the episode was labelled episode/end_abort (the label of a turn the engine gave up on)
    instead of episode/end_env_timeout."""
    from roll_core.agentic.agent_sessions import AgentSessions, ChatTurn, SessionError, SessionLimits
    from roll_core.agentic.chat import TurnTemplate
    from roll_core.agentic.openai_server import HermesToolParser
    from roll_core.interfaces import SamplingParams
    from roll_core.pipelines.collectors.agents import AgentCollector, agent_metrics

    tok = build_tiny_tokenizer()
    engine = _Hanging(tok)
    c = AgentCollector.__new__(AgentCollector)
    c.sessions = AgentSessions(engine, TurnTemplate(tok), lambda ids: tok.decode(ids), HermesToolParser())
    c.server = SimpleNamespace(base_url=lambda sid: sid, reward_url=lambda sid: sid)
    c.limits = SessionLimits(max_tokens_per_turn=8, max_context_length=1024)
    refused: list[SessionError] = []

    def run_episode(sid: str, reward_url: str, row: Any) -> float:
        first = c.sessions.chat(sid, ChatTurn(messages=[{"role": "user", "content": "hi"}]))
        try:
            c.sessions.chat(sid, ChatTurn(messages=[{"role": "user", "content": "hi"}, first.message, row]))
        except SessionError as exc:  # the 410 its closed session answers
            refused.append(exc)
        return 1.0

    c.task = SimpleNamespace(run_episode=run_episode, episode_timeout_s=0.5, failure_reward=-1.0, success_reward=1.0)
    ep = c.episode("ep0", {"role": "user", "content": "more"}, 0, 0, SamplingParams(max_new_tokens=8))
    assert engine.waiting.is_set() and refused and refused[0].status == 410  # it was mid-request when closed
    assert (ep.failure, ep.reward, ep.traj.turns, ep.traj.end) == ("timeout", -1.0, 1, "env_timeout")
    m = agent_metrics([ep])
    assert m["episode/end_env_timeout"] == 1.0 and "episode/end_abort" not in m
    assert m["agent/failed_timeout"] == 1.0 and m["agent/resumed_turns"] == 0.0
