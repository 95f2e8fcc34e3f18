"""Asynchronous agentic rollout and turn requests that never return (roll_core.agentic.turn_gate, "Requests that never
return"): a turn request the gate aborted whose handle never completes is lost after `abort_timeout_s` (the sync
goes on, the turn resumes with what its earlier attempts generated, no id stays in the gate), one whose handle raises
is a loss too (the episode goes on), a close does not hang on an engine that never answers, an abort sent before the
engine knew the request is sent again; a turn request the engine fails (not aborted) stops the async collector with
an error naming the group, episode and request, and a hung engine times the batch out naming what runs. Fake
engines, no Ray."""

from __future__ import annotations

import logging
import re
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
from roll_core.agentic.turn_gate import TurnGate
from roll_core.interfaces import Request, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors.episodes_async import AsyncEpisodeCollector
from roll_core.pipelines.metrics import StepLog
from roll_core.testing.held_requests import HeldRequestEngine

BOUND = 0.2  # abort_timeout_s in these tests: short, since waiting it out is what they test
TOK = build_tiny_tokenizer()
A, B = (TOK(c, add_special_tokens=False)["input_ids"][0] for c in ("a", "b"))


class Corridor:
    """Any reply moves on; never ends by itself (the episode ends at max_turns)."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "Go.", {"state": "0"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "Go.", 0.0, False, False, {"state": "0"}


def _engine(**kwargs: Any) -> HeldRequestEngine:
    """Requests held until the test acts on them: an aborted one ends with one token 'a' (log-prob -0.5), a served
    one with one token 'b' (-0.25); `kwargs` go to HeldRequestEngine (`on_abort`, `preempt`)."""
    return HeldRequestEngine(abort_tokens=[A], serve_tokens=[B], **kwargs)


def _first_turn_request(request: Request) -> bool:
    """A `preempt`: the engine aborts the first request of an episode's first turn (episode-<i>-turn-0) itself at
    once with one token 'a'; the turn resumes from it (episode-<i>-turn-0-<k>: not preempted)."""
    return request.request_id.endswith("-turn-0")


def _episodes(
    engine: HeldRequestEngine, gate: TurnGate, n: int
) -> tuple[list[threading.Thread], dict[int, Any], EnvManager]:
    """`n` one-turn episodes (turn budget 8) running in threads; each one's trajectory or error lands in the dict."""
    envs = EnvManager(Corridor, n, step_timeout_s=10)
    rollout = AgenticRollout(engine, envs, TurnTemplate(TOK, "Go."), TOK, EpisodeLimits(1, 2048, 8), gate)
    got: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            got[i] = rollout.episode(i, i, 0, SamplingParams(max_new_tokens=999, seed=1))
        except Exception as exc:  # the old code's: an aborted request's error failed the episode
            got[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, got, envs


def _gate_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "roll_core.agentic.turn_gate" and r.levelno >= 30]


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an episode thread still blocked on its request"


def test_a_sync_abort_the_engine_never_answers_is_lost_and_the_turn_resumes_with_its_prefix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Partial rollout: the engine preempts each turn once (the turn keeps [a] and resumes); then, at the weight
    sync, the engine has restarted and answers no abort. The sync waited 600 s and failed the run, the episode
    threads stayed blocked on their handles for good. Now, after abort_timeout_s, the requests are lost: the sync
    goes on, no id stays in the gate, and each turn resumes from [a] with the rest of its budget."""
    engine = _engine(preempt=_first_turn_request)
    gate = TurnGate(engine, partial_rollout=True, abort_timeout_s=BOUND)
    caplog.set_level(logging.WARNING, logger="roll_core.agentic.turn_gate")
    threads, got, envs = _episodes(engine, gate, 2)
    try:
        engine.wait_running(2)  # the resumptions episode-*-turn-0-1
        lost = sorted(engine.running)
        first = {r.request_id: r for r in engine.requests}
        engine.on_abort = "deaf"
        t0 = time.monotonic()
        gate.begin_update(timeout_s=60)  # waits abort_timeout_s, then goes on without the lost requests
        assert time.monotonic() - t0 < 30  # (without the bound: a TimeoutError after the 60 s)
        assert gate.running() == [] and not gate._aborted
        assert gate.stats() == {"async/unanswered_aborts": 2.0, "async/failed_aborts": 0.0}
        assert set(engine.aborts) == set(lost)
        mark = len(engine.requests)
        engine.on_abort = "partial"
        gate.finish_update(1)
        engine.wait_running(4)  # the lost requests (still "running" in the engine) and their resumptions
        for r in engine.requests[mark:]:
            base = first[r.request_id.rsplit("-", 1)[0]]  # the turn's first request
            assert r.prompt_ids == [*base.prompt_ids, A] and r.params.max_new_tokens == 7
        engine.serve()
        _join(threads)
    finally:
        engine.release()
        envs.close()
    for traj in got.values():
        assert traj.end == "max_turns" and traj.tokens == [A, B] and traj.logprobs == [-0.5, -0.25]
        assert traj.resumed_turns == 2 and traj.versions == [0] and not traj.untrained
    assert gate.stats() == {"async/unanswered_aborts": 0.0, "async/failed_aborts": 0.0}  # since the last call
    warnings = _gate_warnings(caplog)  # one at the first loss, the rest summed up at finish_update
    assert len(warnings) == 2
    assert "lost at version 0" in warnings[0] and "no result within 0.2 s" in warnings[0]
    assert "1 more aborted turn request(s) lost at version 0 (async/unanswered_aborts 1)" in warnings[1]


def test_an_aborted_turn_whose_result_raises_resumes_instead_of_failing_the_episode() -> None:
    """The abort reached a dying worker: reading the handle raised, which failed the episode and with it the run
    (the collector raised it at the trainer's next call). Now it is a loss: the turn resumes after the sync."""
    engine = _engine()
    gate = TurnGate(engine, partial_rollout=True, abort_timeout_s=BOUND)
    threads, got, envs = _episodes(engine, gate, 1)
    try:
        engine.wait_running(1)
        engine.on_abort = "raise"
        gate.begin_update(timeout_s=60)
        assert gate.stats() == {"async/unanswered_aborts": 0.0, "async/failed_aborts": 1.0}
        gate.finish_update(1)
        engine.wait_running(1)
        assert engine.requests[-1].params.max_new_tokens == 8  # nothing of the lost request is kept
        engine.serve()
        _join(threads)
    finally:
        engine.release()
        envs.close()
    traj = got[0]
    assert not isinstance(traj, Exception), traj
    assert (traj.end, traj.tokens, traj.resumed_turns, traj.versions) == ("max_turns", [B], 1, [0])


def test_close_does_not_hang_on_an_engine_that_never_answers() -> None:
    """The collector's close aborts the running turns and joins their threads: with an engine that never answers,
    the threads (and so the close) blocked for good. Now the request is lost after abort_timeout_s and the episode
    ends `abort`, untrained."""
    engine = _engine(on_abort="deaf")
    gate = TurnGate(engine, partial_rollout=True, abort_timeout_s=BOUND)
    threads, got, envs = _episodes(engine, gate, 1)
    try:
        engine.wait_running(1)
        gate.close()
        _join(threads)
    finally:
        engine.release()
        envs.close()
    traj = got[0]
    assert (traj.end, traj.untrained, traj.error, traj.tokens) == ("abort", True, "collector closed", [])
    assert gate.running() == [] and gate.stats()["async/unanswered_aborts"] == 1.0


def test_an_abort_sent_before_the_engine_knew_the_request_is_sent_again() -> None:
    """A turn entered the gate, then a sync aborted it before it was submitted (the engine knew nothing to abort):
    its wait sends the abort again, so the partial result comes at once instead of the request being lost."""
    engine = _engine()
    gate = TurnGate(engine, partial_rollout=True, abort_timeout_s=3600)
    assert gate.enter("r") == 0
    sync = threading.Thread(target=gate.begin_update, kwargs={"timeout_s": 60}, daemon=True)
    sync.start()
    deadline = time.monotonic() + 60
    while "r" not in engine.aborts:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    handle = engine.submit_request(Request("r", [1, 2], SamplingParams(max_new_tokens=4)))
    try:
        out = gate.wait("r", handle)
    finally:
        engine.release()
    assert (out.token_ids, out.finish_reason) == ([A], "abort") and engine.aborts == ["r", "r"]
    assert gate.leave("r") is True  # the gate's abort: resumed after the sync
    sync.join(60)
    assert not sync.is_alive() and gate.stats()["async/unanswered_aborts"] == 0.0


def test_abort_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="abort_timeout_s=0"):
        TurnGate(_engine(), partial_rollout=True, abort_timeout_s=0)


# ---- the asynchronous collector ------------------------------------------------------------------------------
def _collector(engine: HeldRequestEngine, timeout_s: float) -> AsyncEpisodeCollector:
    """AsyncEpisodeCollector around its bookkeeping, k=0, one group of one episode, with the real rollout and gate."""
    c = object.__new__(AsyncEpisodeCollector)
    c.k, c.groups_per_batch, c.group_size, c.timeout_s = 0, 1, 1, timeout_s
    c._free_slots, c._pool = [0], ThreadPoolExecutor(1)
    c._cv, c._version, c._started, c._taken, c._skipped = threading.Condition(), 0, 0, 0, 0
    c._results, c._first_step, c._seeds, c._error, c._closed, c._last_batch_at = {}, None, {}, None, False, None
    c.cfg = types.SimpleNamespace(pipeline=types.SimpleNamespace(seed=0))
    c.sampling = SamplingParams(max_new_tokens=999)
    c.train_seeds = lambda step: [17]
    c.gate = TurnGate(engine, partial_rollout=True, abort_timeout_s=BOUND)
    c.envs = EnvManager(Corridor, 1, step_timeout_s=10)
    c.rollout = AgenticRollout(engine, c.envs, TurnTemplate(TOK, "Go."), TOK, EpisodeLimits(1, 2048, 8), c.gate)
    return c


def test_a_turn_request_the_engine_fails_stops_the_collector_naming_the_episode_and_request() -> None:
    """The trainer's next call raised "async episodes failed: <engine error>", naming neither the episode nor the
    request; now both, chained to the engine's error (whose type is kept: a dead worker stays a fault)."""
    engine = _engine()
    c = _collector(engine, timeout_s=30)
    waiter = ThreadPoolExecutor(1)
    try:
        taking = waiter.submit(c.next, 1, StepLog())
        engine.wait_running(1)
        engine.fail(ValueError("CUDA error: device lost"))
        with pytest.raises(RuntimeError) as err:
            taking.result(timeout=10)
    finally:
        engine.release()
        c._pool.shutdown(wait=True)
        waiter.shutdown(wait=True)
        c.envs.close()
    msg = str(err.value)
    assert msg.startswith("async episodes failed (group 0, episode 0, env seed 17): ")
    assert "turn request episode-0-turn-0 (turn 0 of episode-0, env seed 17) failed in the inference engine" in msg
    assert msg.endswith("ValueError: CUDA error: device lost")
    assert isinstance(err.value.__cause__, ValueError)


def test_a_hung_engine_times_the_batch_out_naming_the_running_requests() -> None:
    """An engine that never answers a live request: the batch wait timed out without saying what it waited for;
    then it named the requests but not how long each had run (nothing aborts a live request, so this timeout is its
    only bound: the age tells a hung request from a slow batch), as the prompts collector's take timeout does."""
    engine = _engine()
    c = _collector(engine, timeout_s=2.0)  # room for the turn to reach the engine on a loaded machine
    try:
        with pytest.raises(TimeoutError) as err:
            c.next(1, StepLog())
    finally:
        c.gate.close()  # aborts the running turn (this engine answers aborts)
        c._pool.shutdown(wait=True)
        engine.release()
        c.envs.close()
    msg = str(err.value)
    assert "batch not complete after 2.0s (pipeline.async_batch_timeout_s)" in msg
    match = re.fullmatch(
        re.escape(
            "async episodes: batch not complete after 2.0s (pipeline.async_batch_timeout_s): 1 episode(s) of groups "
            "0..0 unfinished; 1 turn request(s) running (oldest first, time since submitted): episode-0-turn-0 (AGE "
            "s); requests running without finishing (a hung or slow inference engine?)"
        ).replace("AGE", r"(\d+\.\d)"),
        msg,
    )
    assert match is not None, msg
    assert float(match.group(1)) <= 60, msg  # since the turn's submit, within this test (not a stray clock)
