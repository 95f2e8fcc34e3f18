"""The OpenAI-compatible agent endpoint and engine requests that never return (roll_core.agentic.agent_sessions,
"Requests that never return"), over HTTP on 127.0.0.1: a closed session's request (episode timeout) that the engine
never answers is lost after `abort_timeout_s` (the agent gets HTTP 410, the endpoint thread and the session are
free again), one whose result raises is a 410 too (no engine error, the run goes on), a server close does not leave
threads blocked on a deaf engine, an abort sent before the engine knew the request is sent again, and a live engine
failure is a 500 naming the session and the request. Fake engines, no Ray."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from roll_core.agentic.agent_sessions import AgentSessions, ChatTurn, SessionError, SessionLimits
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import HermesToolParser, OpenAIServer
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.held_requests import HeldRequestEngine, threads_left

BOUND = 0.2  # abort_timeout_s in these tests: short, since waiting it out is what they test
TOK = build_tiny_tokenizer()
OK = TOK("ok", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
LIMITS = SessionLimits(max_turns=4, max_tokens_per_turn=16, max_context_length=1024)
HI = [{"role": "user", "content": "hi"}]


def _engine() -> HeldRequestEngine:
    """Requests held until the test acts on them: an aborted one ends with no token, a served one with "ok" + EOS."""
    return HeldRequestEngine(abort_tokens=[], serve_tokens=OK)


def _serve(engine: HeldRequestEngine, max_workers: int = 256) -> tuple[AgentSessions, OpenAIServer]:
    """Sessions bounding aborted requests by BOUND, and a started server with `max_workers` endpoint threads."""
    decode = lambda ids: TOK.decode(ids, skip_special_tokens=True)
    sessions = AgentSessions(engine, TurnTemplate(TOK), decode, HermesToolParser(), abort_timeout_s=BOUND)
    server = OpenAIServer(sessions, max_workers=max_workers)
    server.start()
    return sessions, server


def _post(url: str, answers: list[Any]) -> None:
    """POST a chat request; append (status, JSON body), or (-1, the error) when no answer came within 20 s (a hung
    connection) or the connection went."""
    body = json.dumps({"model": "m", "messages": HI}).encode()
    req = urllib.request.Request(url + "/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            answers.append((resp.status, json.loads(resp.read())))
    except urllib.error.HTTPError as exc:
        answers.append((exc.code, json.loads(exc.read())))
    except OSError as exc:  # a timeout (no answer) or a dropped connection
        answers.append((-1, repr(exc)))


def _in_thread(url: str) -> tuple[threading.Thread, list[Any]]:
    answers: list[Any] = []
    thread = threading.Thread(target=_post, args=(url, answers), daemon=True)
    thread.start()
    return thread, answers


def _turn_in_flight(
    engine: HeldRequestEngine, sessions: AgentSessions, server: OpenAIServer, sid: str
) -> tuple[threading.Thread, list[Any], list[str]]:
    """Open session `sid` and post a chat turn to it from a thread; once its request runs in the engine: the client
    thread, its answers (see `_post`) and the ids of the requests running."""
    sessions.open(sid, PARAMS, LIMITS)
    client, answers = _in_thread(server.base_url(sid))
    return client, answers, engine.wait_running(1)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "roll_core.agentic.turn_gate" and r.levelno >= 30]


def test_a_closed_sessions_request_the_engine_never_answers_is_lost_and_frees_the_endpoint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An episode timed out (its session closed, its request in flight aborted) on an engine that had restarted and
    answered no abort: the endpoint thread serving the request blocked on its handle for good, holding the session's
    lock, the agent's HTTP request got no answer, and with one endpoint thread per episode the next episode's request
    never reached the engine. Now the request is lost after abort_timeout_s: the agent gets 410 session_closed, the
    thread serves the next session, the loss is counted and warned naming the request."""
    engine = _engine()
    sessions, server = _serve(engine, max_workers=1)
    caplog.set_level(logging.WARNING, logger="roll_core.agentic.turn_gate")
    try:
        client_a, answers_a, (rid,) = _turn_in_flight(engine, sessions, server, "a")
        sessions.open("b", PARAMS, LIMITS)
        engine.on_abort = "deaf"
        session = sessions.close("a")  # the episode timeout
        client_a.join(30)
        client_b, answers_b = _in_thread(server.base_url("b"))  # the one endpoint thread: free again?
        engine.wait_running(2)  # a's request, still "running" in the deaf engine, and b's
        engine.serve()
        client_b.join(30)
        sessions.close("b")
    finally:
        engine.release()
        server.close()
    assert answers_a and answers_a[0][0] == 410, answers_a  # was no answer at all (-1: the client's timeout)
    assert answers_a[0][1]["error"]["code"] == "session_closed"
    assert answers_b and answers_b[0][0] == 200, answers_b
    assert answers_b[0][1]["choices"][0]["message"]["content"] == "ok"
    assert engine.aborts == [rid] and rid.startswith("a-")
    assert session.lock.acquire(blocking=False)  # the session's lock is not held by a blocked thread
    assert (session.traj.turns, session.traj.end, session.engine_errors) == (0, "abort", 0)
    assert sessions.gate.running() == [] and not sessions.gate._aborted and not sessions.gate._ended
    assert sessions.gate.stats() == {"async/unanswered_aborts": 1.0, "async/failed_aborts": 0.0}
    (warning,) = _warnings(caplog)
    assert f"aborted turn request {rid} lost" in warning and "no result within 0.2 s of its abort" in warning
    assert "its caller ends (its session closed)" in warning


def test_a_closed_sessions_request_whose_result_raises_is_a_410_and_no_engine_error() -> None:
    """The abort reached a dying worker and reading the handle raised: a 410 (the session ended), no engine error
    counted (the episode is not marked untrained for it), nothing raised beyond the request. (This held before
    through `_engine_failure`'s closed branch; now the gate also counts the loss.)"""
    engine = _engine()
    sessions, server = _serve(engine)
    try:
        client, answers, _ = _turn_in_flight(engine, sessions, server, "r")
        engine.on_abort = "raise"
        session = sessions.close("r")
        client.join(30)
    finally:
        engine.release()
        server.close()
    assert answers and answers[0][0] == 410 and answers[0][1]["error"]["code"] == "session_closed", answers
    assert (session.engine_errors, session.traj.untrained, session.traj.end) == (0, False, "abort")
    assert sessions.gate.stats() == {"async/unanswered_aborts": 0.0, "async/failed_aborts": 1.0}


def test_closing_the_server_on_a_deaf_engine_leaves_no_thread_blocked() -> None:
    """The collector's close closes the server, which aborts the requests in flight: on an engine that never
    answered the abort, the endpoint thread stayed blocked for good (close() itself waited 10 s for the loop's
    thread, and the interpreter joins the pool's threads at exit: the process hung there). Now the request is lost
    after abort_timeout_s, the thread ends, the agent gets 410, close() returns at once and later requests get 410."""
    engine = _engine()
    sessions, server = _serve(engine)
    try:
        client, answers, _ = _turn_in_flight(engine, sessions, server, "h")
        engine.on_abort = "deaf"
        t0 = time.monotonic()
        server.close()
        took = time.monotonic() - t0
        client.join(30)
        workers = threads_left("roll-openai_", within_s=60)
        with pytest.raises(SessionError) as later:
            sessions.chat("h", ChatTurn(messages=HI))
    finally:
        engine.release()
    assert not workers, workers
    assert took < 5, took  # was 10 s: the loop's thread waited on the blocked handler
    # The server's shutdown waits for its handlers: the agent gets its 410 (it got no answer, the connection
    # dropped after 10 s).
    assert answers and answers[0][0] == 410 and answers[0][1]["error"]["code"] == "session_closed", answers
    assert later.value.status == 410 and sessions.gate.stats()["async/unanswered_aborts"] == 1.0
    sessions.close("h")


def test_a_close_during_the_submit_is_sent_again_once_the_engine_knows_the_request() -> None:
    """close() ran while the request was being submitted: its abort reached the engine before the request did (the
    engine found nothing to abort). The turn's wait sends it again, so the request ends at once with a 410 instead
    of running its whole budget (or being lost after the bound)."""
    engine = _engine()
    sessions = AgentSessions(
        engine, TurnTemplate(TOK), lambda ids: TOK.decode(ids), HermesToolParser(), abort_timeout_s=3600
    )
    sessions.open("s", PARAMS, LIMITS)
    engine.on_submit = lambda request: sessions.close("s")
    try:
        with pytest.raises(SessionError) as err:
            sessions.chat("s", ChatTurn(messages=HI))
    finally:
        engine.release()
    rid = engine.aborts[0]
    assert err.value.status == 410 and engine.aborts == [rid, rid] and not engine.running
    assert sessions.gate.running() == [] and sessions.gate.stats()["async/unanswered_aborts"] == 0.0


def test_a_live_engine_failure_is_a_500_naming_the_session_and_the_request(caplog: pytest.LogCaptureFixture) -> None:
    """A request that was not aborted fails in the engine: the agent gets 500 engine_error (its JSON names the
    session and, now, the request, as the logged warning does), the run goes on."""
    engine = _engine()
    sessions, server = _serve(engine)
    caplog.set_level(logging.WARNING, logger="roll_core.agentic.agent_sessions")
    try:
        client, answers, (rid,) = _turn_in_flight(engine, sessions, server, "f")
        engine.fail(ValueError("CUDA error: device lost"))
        client.join(30)
        session = sessions.close("f")
    finally:
        engine.release()
        server.close()
    assert answers and answers[0][0] == 500, answers
    err = answers[0][1]["error"]
    assert (err["code"], err["type"]) == ("engine_error", "server_error")
    assert err["message"] == (
        f"session f: the inference engine failed during request {rid} (ValueError: CUDA error: device lost)"
    )
    assert session.engine_errors == 1 and session.traj.untrained
    assert any(rid in r.getMessage() and r.exc_info for r in caplog.records if r.levelno >= logging.WARNING)


def test_abort_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="abort_timeout_s=0"):
        AgentSessions(_engine(), TurnTemplate(TOK), TOK.decode, HermesToolParser(), abort_timeout_s=0)
