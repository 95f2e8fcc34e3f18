"""How the agent collector reads an episode's outcome and turns it into metrics (pipeline=agent): rewards a
program returns as NumPy or torch numbers, and per-turn rates after a history restart."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from roll_core.agentic.agent_sessions import AgentSession, SessionLimits
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.collectors.agents import Episode, _outcome, agent_metrics


def _session() -> AgentSession:
    return AgentSession("s", SamplingParams(), SessionLimits(), template=None)


@pytest.mark.parametrize(
    "value, want",
    [(1, 1.0), (0.5, 0.5), (np.float32(1), 1.0), (np.int64(1), 1.0), (np.array(0.25), 0.25), (torch.tensor(2.0), 2.0)],
)
def test_a_numeric_reward_of_any_common_type_is_the_episodes_reward(value: Any, want: float) -> None:
    """np.float32(1.0) from a program was a failed episode, trained with the failure reward."""
    assert _outcome({"reward": value}, _session(), timed_out=False) == (want, None, "")


@pytest.mark.parametrize("value", [True, np.bool_(True), "1.0", float("nan"), np.array([1.0, 2.0]), [1.0]])
def test_a_reward_that_is_not_one_finite_number_fails_the_episode(value: Any) -> None:
    reward, failure, why = _outcome({"reward": value}, _session(), timed_out=False)
    assert (reward, failure) == (0.0, "error") and "not a finite number" in why


def test_per_turn_rates_count_the_turns_kept_after_a_history_restart() -> None:
    """Three requests of 5 sampled tokens; a restart at the third dropped the first two turns: the kept turn's
    length is 5 tokens (it read 5/3 when divided by every request)."""
    session = _session()
    session.requests, session.dropped_turns = 3, 2
    session.traj.prompt_ids = [1, 2]
    session.traj.add_response([5, 6, 7, 8, 9], [-0.1] * 5)
    session.traj.turn_rewards.append(1.0)
    m = agent_metrics([Episode(row={}, traj=session.traj, reward=1.0, failure=None, session=session)])
    assert m["response/length_mean"] == 5.0 and m["episode/turns_mean"] == 3.0


@pytest.mark.parametrize("end", ["max_turns", "max_context"])
def test_an_episode_that_hit_a_limit_is_scored_not_failed(end: str) -> None:
    """The endpoint refused a request past max_turns or the context limit and the program raised on the 400: the
    episode ended there and scores 0 (or the reward it reported), never a failure that on_failure=drop would hide."""
    session = _session()
    session.traj.end = end
    refused = RuntimeError("Error code: 400 - max_turns_exceeded")
    assert _outcome({"error": refused}, session, timed_out=False) == (0.0, None, "")
    session.reward = 0.5  # POSTed before the limit
    assert _outcome({"error": refused}, session, timed_out=False) == (0.5, None, "")
    assert _outcome({"error": refused}, _session(), timed_out=False)[1] == "error"  # no limit: a failure


def test_a_timeout_error_of_the_program_is_its_error_not_the_episode_timeout() -> None:
    """Only roll's own episode timeout (`EpisodeTimeout`, or the collector's join running out) is `timeout`: a
    socket or HTTP read timeout inside the program is its error, and after a limit it is no failure at all (any
    TimeoutError was counted as an episode timeout and overrode the limit rule)."""
    from roll_core.pipelines.collectors.agents import EpisodeTimeout

    read_timeout = TimeoutError("read timed out")  # what socket.timeout and urlopen's read timeouts are
    assert _outcome({"error": read_timeout}, _session(), timed_out=False)[:2] == (0.0, "error")
    assert _outcome({"error": EpisodeTimeout("slow")}, _session(), timed_out=False) == (0.0, "timeout", "slow")
    assert _outcome({}, _session(), timed_out=True)[:2] == (0.0, "timeout")
    limited = _session()
    limited.traj.end = "max_turns"
    for result, timed_out in [({"error": read_timeout}, False), ({"error": EpisodeTimeout("x")}, False), ({}, True)]:
        assert _outcome(result, limited, timed_out) == (0.0, None, ""), result
    limited.reward = 0.5  # POSTed before the limit; a value returned after the timeout does not count
    assert _outcome({"reward": 1.0}, limited, timed_out=True) == (0.5, None, "")
