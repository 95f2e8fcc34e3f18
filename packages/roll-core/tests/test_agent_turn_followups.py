"""`pipeline=agent` (the OpenAI-compatible endpoint's sessions, roll_core.agentic.agent_sessions) as the episodes
pipeline (test_agentic_turn_followups.py):

- A stop string the agent asked for (`stop`), split across a turn the engine aborted on its own and its resumed
  attempt (the first ends inside the string, the resumed one completes it), was matched by no engine: the turn ran
  on to its budget. It ends where an unaborted turn stops (roll_core.agentic.resume_stops), the reply and the
  trajectory as without the abort (the hf engine on the tiny model, greedy, through the real `openai` client).
- A turn cut short of its limit by the context (its budget was what was left of max_context_length, or the engine
  stopped it at its own context) is counted in `Trajectory.context_cut_turns` / `episode/context_cut_turn_rate`,
  apart from those cut by the turn's limit (`cut_turns` / `episode/cut_turn_rate`).
"""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from roll_core.agentic.agent_sessions import AgentSessions, ChatTurn, SessionLimits
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import HermesToolParser
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.agent_endpoint import openai_client, serve

sys.path.insert(0, str(Path(__file__).parent))  # agentic_turn_harness, shared by the agentic turn tests
from agentic_turn_harness import RecordingEngine, seeded_words, split_point

BUDGET = 40
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=BUDGET)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def hf_engine() -> Any:
    from roll_core.models import resolve_model_path
    from roll_core.testing.infer_engine import RequestsOf
    from roll_engines.infer.hf import HFInferEngine

    engine = HFInferEngine(resolve_model_path("builtin:tiny"), max_new_tokens=BUDGET, seed=0)
    yield RequestsOf(engine)
    engine.shutdown()


def _turn(infer: Any, tok: Any, words: str, stop: list[str] | None, keep: int | None) -> tuple[Any, Any, Any]:
    """One greedy turn of a fresh session through the endpoint: (the client's reply, the session, the engine)."""
    engine = RecordingEngine(infer, keep)  # the engine's own preemption of the first request
    sessions, server = serve(engine, tok)
    try:
        sessions.open("ep", GREEDY, SessionLimits(max_turns=2, max_tokens_per_turn=BUDGET, max_context_length=512))
        messages = [{"role": "user", "content": words}]
        extra = {} if stop is None else {"stop": stop}
        reply = openai_client(server, "ep").chat.completions.create(model="m", messages=messages, **extra)
        session = sessions.close("ep")
    finally:
        server.close()
    return reply, session, engine


def test_a_stop_string_split_across_an_engine_abort_ends_the_turn_as_without_the_abort(
    hf_engine: Any, tokenizer: Any
) -> None:
    tok, found = tokenizer, None
    for seed in range(40):  # a greedy response long enough to hold a stop string in its middle
        words = seeded_words(seed)
        _, free, _ = _turn(hf_engine, tok, words, None, None)
        found = split_point(tok, free.traj.tokens)
        if found is not None:
            break
    assert found is not None, "no greedy response of the tiny model held a usable stop string"
    stop, k = found
    free_ids = free.traj.tokens
    whole_reply, whole, _ = _turn(hf_engine, tok, words, [stop], None)
    # without an abort the engine stops at the token completing the string (kept); the reply ends before it
    assert whole.traj.tokens == free_ids[: k + 1] and whole_reply.choices[0].finish_reason == "stop"
    content = whole_reply.choices[0].message.content
    assert stop not in content and tok.decode(free_ids[: k + 1], skip_special_tokens=True).startswith(content + stop)
    # the engine aborts the first attempt inside the string (after its first token), the resumed one completes it
    split_reply, split, engine = _turn(hf_engine, tok, words, [stop], k - 1)
    assert split.resumed == 1 and len(engine.requests) == 2
    assert engine.requests[1].prompt_ids == engine.requests[0].prompt_ids + free_ids[: k - 1]
    assert stop not in tok.decode(free_ids[: k - 1]) and stop not in tok.decode(free_ids[k - 1 : k + 1])
    # the reply and the trajectory are the unaborted turn's
    assert split_reply.choices[0].message.content == content
    assert split_reply.choices[0].finish_reason == "stop"
    assert split_reply.usage.completion_tokens == whole_reply.usage.completion_tokens == k + 1
    assert split.traj.tokens == whole.traj.tokens and split.traj.mask == whole.traj.mask
    assert split.traj.logprobs == pytest.approx(whole.traj.logprobs, abs=1e-4)
    assert (split.traj.cut_turns, split.traj.context_cut_turns) == (0, 0)


# ---- turns cut by their limit and turns cut by the context ----------------------------------------------------------
class LengthEngine:
    """Request k answers `wants[k]` tokens 'a' within its budget ('length' when the budget cut it, else 'stop');
    `engine_cut`: the request numbers the engine cut at its own context after `wants[k]` tokens ('length')."""

    def __init__(self, tok: Any, wants: list[int], engine_cut: tuple[int, ...] = ()) -> None:
        self.token = tok("a", add_special_tokens=False)["input_ids"][0]
        self.wants, self.engine_cut = list(wants), engine_cut
        self.budgets: list[int] = []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        k, budget = len(self.budgets), request.params.max_new_tokens
        self.budgets.append(budget)
        n = min(self.wants[k], budget)
        finish = "length" if n == budget or k in self.engine_cut else "stop"
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [self.token] * n, [-0.5] * n, finish))
        return fut

    def abort(self, request_id: str) -> bool:
        return False


def _episode(tok: Any, engine: LengthEngine, limits: SessionLimits, max_tokens: list[int | None]) -> Any:
    """An agent that says "go" once per entry of `max_tokens` (its request's max_tokens), extending the conversation;
    the finished Episode (reward 1)."""
    from roll_core.pipelines.collectors.agents import Episode

    sessions = AgentSessions(engine, TurnTemplate(tok), lambda ids: tok.decode(ids), HermesToolParser())
    sessions.open("ep", SamplingParams(max_new_tokens=999), limits)
    messages: list[dict[str, Any]] = []
    for cap in max_tokens:
        messages.append({"role": "user", "content": "go"})
        reply = sessions.chat("ep", ChatTurn(messages=list(messages), max_tokens=cap))
        messages.append(reply.message)
    session = sessions.close("ep")
    return Episode({}, session.finish(1.0, "done"), 1.0, None, session)


def test_turns_cut_by_the_context_are_counted_apart_from_turns_cut_by_their_limit() -> None:
    from roll_core.pipelines.collectors.agents import agent_metrics

    tok = build_tiny_tokenizer()
    prompt = TurnTemplate(tok).initial_messages([{"role": "user", "content": "go"}])
    # the session's limit (8), the request's own max_tokens (4): cut by the turn's limit; a turn that stopped: none
    limited = _episode(tok, LengthEngine(tok, [9, 9, 2]), SessionLimits(3, 8, 4096), [None, 4, None])
    assert (limited.traj.turns, limited.traj.cut_turns, limited.traj.context_cut_turns) == (3, 2, 0)
    # the first turn's budget is the context left (5 < 8): a context cut
    engine = LengthEngine(tok, [9])
    short = _episode(tok, engine, SessionLimits(3, 8, len(prompt) + 5), [None])
    assert engine.budgets == [5] and (short.traj.cut_turns, short.traj.context_cut_turns) == (0, 1)
    # the engine stopped the second turn at its own context after 3 of its 8 tokens: a context cut
    engine_cut = _episode(tok, LengthEngine(tok, [9, 3], engine_cut=(1,)), SessionLimits(3, 8, 4096), [None, None])
    assert (engine_cut.traj.cut_turns, engine_cut.traj.context_cut_turns) == (1, 1)
    m = agent_metrics([limited, short, engine_cut])
    assert m["episode/cut_turn_rate"] == pytest.approx(3 / 6)
    assert m["episode/context_cut_turn_rate"] == pytest.approx(2 / 6)
