"""The remote reward (roll_envs.rewards.remote) against real HTTP servers on 127.0.0.1: the reference verifier
(roll_envs.rewards.serve) started from its command line and serving the math reward, and a scripted server that
misbehaves on purpose (503s, 429 with Retry-After, slow replies, non-JSON, wrong row counts, NaN, 400), records
the requests in flight and echoes what arrived. Also: through GuardedReward's forked child, off the main thread,
inside a running event loop, and composed from the config (`env/reward=remote`)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="pip install 'roll-envs[remote]'")
from aiohttp import web

from roll_core.cluster.reward_guard import GuardedReward
from roll_core.errors import ConfigError
from roll_core.testing.rewards import Case, RewardTestSuite
from roll_envs.rewards.remote import COUNTERS, RemoteReward
from roll_envs.rewards.serve import RunningServer, build_reward, serve_in_thread

#: Math rows: boxed right, LaTeX right (math-verify's symbolic path), unboxed right number, wrong, nothing.
RESPONSES = ["so \\boxed{12}", "\\boxed{\\frac{1}{2}}", "the answer is 7", "\\boxed{13}", "no idea"]
ANSWERS = ["12", "0.5", "7", "12", "3"]


class Script:
    """State of the scripted server: tries per route, requests in flight, what arrived."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.rows: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.extra: list[str | None] = []

    def app(self) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            route = request.match_info["route"]
            n = self.calls[route] = self.calls.get(route, 0) + 1
            rows = (await request.json())["rows"]
            ok = {
                "rows": [
                    {"score": float(len(r["response"])), "correct": int(r["response"] == r["answer"])} for r in rows
                ]
            }
            if route == "flaky" and n <= 2:
                return web.Response(status=503, text="warming up")
            if route == "busy" and n == 1:
                return web.Response(status=429, text="slow down", headers={"Retry-After": "0.3"})
            if route == "slow":
                await asyncio.sleep(2.0)
            if route == "halfsecond":
                await asyncio.sleep(0.5)
            if route == "notjson":
                return web.Response(text="<html>oops</html>")
            if route == "short":
                return web.json_response({"rows": ok["rows"][:-1]})
            if route == "badrows":  # NaN, a string, no score, correct=2, an integer too big for a float, one good row
                bad = [{"score": math.nan}, {"score": "x"}, {"correct": 1}, {"score": 1.0, "correct": 2}]
                bad.append({"score": 10**400})
                return web.Response(text=json.dumps({"rows": [*bad, {"score": 0.25}]}))
            if route == "deep":  # valid JSON, nested deeper than Python's decoder recurses
                return web.Response(text="[" * 100_000 + "]" * 100_000)
            if route == "refused":
                return web.Response(status=400, text="unknown field")
            if route == "list":
                return web.json_response([0.5, 1.0][: len(rows)])
            if route == "huge":  # good rows padded to 50 kB, with a Content-Length
                return web.json_response({**ok, "padding": " " * 50_000})
            if route == "hugestream":  # the same, chunked: no Content-Length tells its size
                stream = web.StreamResponse(headers={"Content-Type": "application/json"})
                await stream.prepare(request)
                await stream.write(json.dumps(ok)[:-1].encode() + b', "padding": "')
                for _ in range(50):
                    await stream.write(b" " * 1000)
                await stream.write(b'"}')
                return stream
            if route == "echo":
                self.rows += rows
                self.auth.append(request.headers.get("Authorization"))
                self.extra.append(f"{request.headers.get('X-Run')} {request.content_type}")
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                await asyncio.sleep(0.1)
                self.in_flight -= 1
                ok["counters"] = {"service_cache_hits": len(rows)}
            return web.json_response(ok)

        async def moved(request: web.Request) -> web.Response:
            self.calls["moved"] = self.calls.get("moved", 0) + 1
            raise web.HTTPFound(f"/answered?from={request.match_info['how']}")

        async def answered(request: web.Request) -> web.Response:  # not the rows: no request body came (a GET)
            return web.json_response({"rows": [{"score": 1.0, "correct": 1}]})

        app = web.Application()
        app.add_routes([web.post("/moved/{how}", moved), web.get("/answered", answered)])
        app.add_routes([web.post("/{route}", handle)])
        return app


@pytest.fixture(scope="module")
def server() -> Any:
    script = Script()
    running = RunningServer(script.app(), "127.0.0.1", 0)
    yield script, f"http://127.0.0.1:{running.port}"
    running.stop()


def _remote(url: str, **kw: Any) -> RemoteReward:
    return RemoteReward(url, **{"backoff_s": 0.01, "timeout_s": 5.0, **kw})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """The server child gets SIGTERM if the test process dies (Linux prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def test_the_reference_server_scores_like_the_reward_it_serves(tmp_path: Path) -> None:
    """`python -m roll_envs.rewards.serve --reward math`: the same scores as MathReward's own, its counters
    forwarded; a malformed request gets 400 with a message; /health answers."""
    from roll_envs.rewards.math import MathReward

    cmd = [sys.executable, "-m", "roll_envs.rewards.serve", "--reward", "math", "--port", "0"]
    cmd += ["-o", "last_number_weight=0.5", "-o", "format_weight=0.1"]
    log = tmp_path / "server.log"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=_die_with_parent)
    try:
        own = MathReward(last_number_weight=0.5, format_weight=0.1).score(RESPONSES, ANSWERS)  # while it starts
        line = proc.stdout.readline()
        assert "serving reward 'math' at http://127.0.0.1:" in line, (line, log.read_text())
        url = line.split(" at ")[1].strip()
        remote = _remote(url, batch_size=2).score(RESPONSES, ANSWERS, prompts=["p"] * 5, metadata=[{}] * 5)
        assert remote.scores == pytest.approx(own.scores) and remote.scores == pytest.approx([1.1, 1.1, 0.5, 0.1, 0.0])
        assert (remote.correct, remote.formatted) == (own.correct, own.formatted)
        assert remote.counters["no_boxed"] == own.counters["no_boxed"] == 2  # the service's own counters
        assert all(remote.counters[k] == 0 for k in COUNTERS)

        bad = urllib.request.Request(url, data=b'{"rows": [{"answer": "1"}]}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad, timeout=10)
        assert err.value.code == 400 and 'row 0: \\"response\\" must be a string' in err.value.read().decode()
        health = json.loads(urllib.request.urlopen(url.replace("/score", "/health"), timeout=10).read())
        assert health == {"status": "ok", "reward": "math"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_build_reward_checks_options_against_the_schema() -> None:
    with pytest.raises(ConfigError, match=r"correct_weigth.*its options .*correct_weight"):
        build_reward("math", {"correct_weigth": 2})
    with pytest.raises(ConfigError, match=r"no such reward; installed: .*math"):
        build_reward("maths")
    assert build_reward("countdown", {"format_weight": "0.5"}).format_weight == 0.5  # typed by the schema


def test_retries_then_scores(server: Any) -> None:
    """503 twice then OK: right scores, two retries counted; 429 with Retry-After: the wait is honoured."""
    script, base = server
    res = _remote(f"{base}/flaky").score(["ab", "c"], ["ab", "x"])
    assert (res.scores, res.correct) == ([2.0, 1.0], [1.0, 0.0])
    assert res.counters == {
        "remote_timeouts": 0,
        "remote_errors": 0,
        "remote_malformed": 0,
        "remote_failed": 0,
        "remote_retries": 2,
        "unscored": 0,
    }
    assert script.calls["flaky"] == 3
    start = time.monotonic()
    res = _remote(f"{base}/busy").score(["abc"], ["abc"])
    assert res.scores == [3.0] and res.counters["remote_retries"] == 1
    assert time.monotonic() - start >= 0.3  # Retry-After: 0.3, not backoff_s=0.01


def test_failures_are_counted_rows(server: Any) -> None:
    script, base = server
    rows = (["a", "bb", "ccc"], ["a", "x", "y"])
    # Slower than timeout_s on both tries: every row a timeout, scored error_score.
    res = _remote(f"{base}/slow", timeout_s=0.3, max_retries=1, error_score=-1.0).score(*rows)
    assert (res.scores, res.correct, res.formatted) == ([-1.0] * 3, [0.0] * 3, [0.0] * 3)
    assert (res.counters["remote_timeouts"], res.counters["remote_retries"], script.calls["slow"]) == (3, 1, 2)
    # Not JSON; one row short: the whole request's rows are malformed, not retried.
    for route in ("notjson", "short"):
        res = _remote(f"{base}/{route}", batch_size=2).score(*rows)
        assert res.scores == [0.0] * 3 and res.counters["remote_malformed"] == 3, route
        assert res.counters["remote_retries"] == 0 and script.calls[route] == 2, route  # two requests, once each
    # Bad rows are malformed one by one; the good row keeps its score (correct from correct_threshold).
    res = _remote(f"{base}/badrows", correct_threshold=0.2).score(["r"] * 6, ["a"] * 6)
    assert (res.scores, res.correct) == ([0.0] * 5 + [0.25], [0] * 5 + [1.0])
    assert res.counters["remote_malformed"] == 5 and res.counters["unscored"] == 5
    # 400: an error, never retried.
    reward = _remote(f"{base}/refused", max_retries=3)
    res = reward.score(*rows)
    assert res.counters["remote_errors"] == 3 and res.counters["remote_retries"] == 0 and script.calls["refused"] == 1
    assert "HTTP 400" in reward.last_failure and "unknown field" in reward.last_failure
    # A bare list of numbers is a reply too.
    assert _remote(f"{base}/list").score(["a", "b"], ["", ""]).scores == [0.5, 1.0]


def test_a_reply_over_the_size_cap_is_malformed_and_read_no_further(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply body was read whole into memory whatever its size (200 MB of reply took 600 MB of the reward worker).
    One over MAX_REPLY_BYTES (here 10 kB) is malformed, its rows counted, not retried; sized or chunked."""
    from roll_envs.rewards import remote

    script, base = server
    monkeypatch.setattr(remote, "MAX_REPLY_BYTES", 10_000)
    for route in ("huge", "hugestream"):
        reward = _remote(f"{base}/{route}", max_retries=2)
        res = reward.score(["a", "b"], ["a", "b"])
        assert res.failed == [True, True] and res.counters["remote_malformed"] == 2, route
        assert res.counters["remote_retries"] == 0 and script.calls[route] == 1, route
        assert reward.last_failure is not None and "over 10000 bytes" in reward.last_failure
    monkeypatch.setattr(remote, "MAX_REPLY_BYTES", 100_000)  # under the cap: scored
    assert _remote(f"{base}/hugestream").score(["a", "bb"], ["a", "x"]).scores == [1.0, 2.0]


def test_a_redirect_that_drops_the_post_is_a_counted_error(server: Any) -> None:
    """A 302 (an http -> https proxy, a moved route) made aiohttp ask its target with a GET, without the rows, and
    whatever answered that was taken as their scores: here 1.0, correct, for a row nobody scored. It is an error
    naming the redirect, not retried."""
    script, base = server
    reward = _remote(f"{base}/moved/302", max_retries=2)
    res = reward.score(["a"], ["b"])
    assert res.failed == [True] and res.scores == [0.0] and res.correct == [0.0]
    assert (res.counters["remote_errors"], res.counters["remote_retries"], script.calls["moved"]) == (1, 0, 1)
    assert reward.last_failure is not None and "302 to /answered" in reward.last_failure


def test_a_request_that_breaks_unforeseen_is_a_counted_error(server: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A reply too deep to decode (RecursionError) or metadata JSON cannot encode (a tuple key: TypeError) left
    the rows unscored with no remote_* counter, no `last_failure` and asyncio's "Task exception was never
    retrieved"; now they count in remote_errors, the other requests' rows unharmed."""
    _, base = server
    reward = _remote(f"{base}/deep", batch_size=2)
    res = reward.score(["a", "b", "c"], ["x"] * 3)
    assert res.failed == [True] * 3 and res.scores == [0.0] * 3
    assert (res.counters["remote_errors"], res.counters["unscored"]) == (3, 3)
    assert reward.last_failure is not None and "RecursionError" in reward.last_failure
    reward = _remote(f"{base}/plain", batch_size=1)
    res = reward.score(["a", "bb", "ccc"], ["a"] * 3, metadata=[{}, {("tuple", "key"): 1}, {}])
    assert res.scores == [1.0, 0.0, 3.0] and res.failed == [False, True, False]  # rows stay matched to requests
    assert (res.counters["remote_errors"], res.counters["unscored"]) == (1, 1)
    assert reward.last_failure is not None and "rows 1..1: TypeError" in reward.last_failure
    assert "never retrieved" not in caplog.text


def test_a_dead_service_fails_every_row_after_its_retries() -> None:
    res = _remote(f"http://127.0.0.1:{_free_port()}/score", max_retries=2, batch_size=2).score(["a"] * 3, ["a"] * 3)
    assert res.scores == [0.0] * 3 and res.counters["remote_errors"] == 3
    assert res.counters["remote_retries"] == 4  # two requests, two retries each


def test_a_dead_service_stops_the_run_through_the_failure_budget() -> None:
    """Every row unscored (the service is down; a 401 for a bad key is the same): the guard counts the rows as failed,
    so the run's RewardFailureBudget stops it (it trained on error_score forever: the rows were the reward's own
    fallback scores, which the guard did not count)."""
    from roll_core.cluster.reward_guard import RewardFailureBudget, RewardFailureError, all_rows_failed

    guarded = GuardedReward(_remote(f"http://127.0.0.1:{_free_port()}/score", max_retries=0), isolation="inline")
    budget = RewardFailureBudget(max_steps=2)
    res = guarded.score(["a", "b", "c"], ["1", "2", "3"])
    assert res.counters["unscored"] == 3 and res.counters["failed_unscored"] == res.counters["failed_rows"] == 3
    assert all_rows_failed(res.counters) and "could not score 3 of 3 rows" in guarded.last_failure
    budget.update(1, res.counters, guarded.last_failure)
    with pytest.raises(RewardFailureError, match=r"3 unscored by the reward itself; first failure: .*could not score"):
        budget.update(2, guarded.score(["a", "b", "c"], ["1", "2", "3"]).counters, guarded.last_failure)


def test_a_slow_service_keeps_what_it_scored_within_the_guards_batch_timeout(server: Any) -> None:
    """A healthy service slower than the guard's batch timeout allows for the whole batch (0.5 s a request, one at
    a time, 6 requests, 2 s): the reward stops at its time budget and keeps the rows already scored; the rest
    are counted, unscored. (The guard cut the call off at 2 s, losing the 3 finished requests' scores, and
    rescored row by row: 7 s.)"""
    _, base = server
    reward = _remote(f"{base}/halfsecond", batch_size=2, max_concurrency=1)
    guarded = GuardedReward(reward, isolation="process", batch_timeout_s=2.0, timeout_s=1.0)
    responses = [f"r{'x' * i}" for i in range(12)]
    start = time.monotonic()
    res = guarded.score(responses, ["a"] * 12)
    took = time.monotonic() - start
    guarded.close()
    done = [i for i, s in enumerate(res.scores) if s == float(len(responses[i]))]
    # Well under the row-by-row rescoring's 7 s; the margin over 2 s is a loaded CI machine's (2.67 s seen there).
    assert took < 4.0 and done == list(range(len(done))) and len(done) >= 4, (took, res.scores)
    assert res.counters["remote_timeouts"] == res.counters["failed_unscored"] == 12 - len(done)
    assert res.counters["timeouts"] == 0  # no cut-off, no row-by-row pass


def test_concurrency_limit_and_context_arrive(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most max_concurrency requests in flight (and that many used); prompts, metadata, the API key from the
    named environment variable and extra headers reach the service; the service's counters are added."""
    script, base = server
    monkeypatch.setenv("VERIFIER_KEY", "s3cret")
    script.rows.clear()
    n = 10
    reward = _remote(
        f"{base}/echo", batch_size=1, max_concurrency=3, api_key_env="VERIFIER_KEY", headers={"X-Run": "7"}
    )
    meta = [{"domain": "math", "i": i} for i in range(n)]
    res = reward.score([f"r{i}" for i in range(n)], ["r0"] * n, prompts=[f"p{i}" for i in range(n)], metadata=meta)
    assert script.max_in_flight == 3
    assert res.scores == [2.0] * n and res.correct == [1.0] + [0.0] * (n - 1)
    assert res.counters["service_cache_hits"] == n
    arrived = sorted(script.rows, key=lambda r: r["metadata"]["i"])
    assert [(r["prompt"], r["metadata"]) for r in arrived] == [(f"p{i}", meta[i]) for i in range(n)]
    assert set(script.auth) == {"Bearer s3cret"} and set(script.extra) == {"7 application/json"}
    monkeypatch.delenv("VERIFIER_KEY")
    with pytest.raises(ConfigError, match="VERIFIER_KEY is not set"):
        _remote(f"{base}/echo", api_key_env="VERIFIER_KEY")
    with pytest.raises(ConfigError, match="do not put the API key"):
        _remote(f"{base}/echo", headers={"authorization": "Bearer s3cret"})


def test_in_a_forked_child_off_the_main_thread_and_inside_an_event_loop(server: Any) -> None:
    """GuardedReward's process isolation (a forked child), a worker thread, and a thread whose loop is running."""
    script, base = server
    reward = _remote(f"{base}/echo", batch_size=2)
    responses, answers, prompts = ["a", "bb", "ccc"], ["a", "b", "ccc"], ["x", "y", "z"]
    guarded = GuardedReward(reward, isolation="process", timeout_s=10, batch_timeout_s=20)
    script.rows.clear()
    res = guarded.score(responses, answers, prompts=prompts, metadata=[{"k": 1}] * 3)
    assert (res.scores, res.correct, res.counters["failed_rows"]) == ([1.0, 2.0, 3.0], [1.0, 0.0, 1.0], 0)
    assert guarded._child is not None and guarded._child._pid not in (None, os.getpid())
    assert sorted(r["prompt"] for r in script.rows) == prompts

    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(res=reward.score(responses, answers)))
    thread.start()
    thread.join(30)
    assert out["res"].scores == [1.0, 2.0, 3.0]

    async def inside_a_loop() -> Any:
        return reward.score(responses, answers)

    assert asyncio.run(inside_a_loop()).scores == [1.0, 2.0, 3.0]


def test_the_config_composes() -> None:
    from roll_core.config import load_config
    from roll_core.config.build import build

    base = ["model=tiny", "env=arithmetic", "env.train_size=20", "env.eval_size=5", "env/reward=remote"]
    cfg = load_config([*base, "env.reward.url=http://127.0.0.1:9/score", "env.reward.max_concurrency=2"])
    reward = build(cfg.env).reward
    assert isinstance(reward, RemoteReward)
    assert (reward.url, reward.max_concurrency, reward.batch_size) == ("http://127.0.0.1:9/score", 2, 16)
    with pytest.raises(ConfigError, match="urll"):
        load_config([*base, "env.reward.urll=http://x"])


class _Contextual:
    """Scores 1 when the response repeats the prompt and the metadata's `domain` is "math"."""

    def score(self, responses, answers, prompts=None, metadata=None):
        from roll_core.interfaces import RewardResult

        ok = [float(r == p and m.get("domain") == "math") for r, p, m in zip(responses, prompts, metadata)]
        return RewardResult(scores=ok, correct=ok, formatted=[1.0] * len(ok))


def test_the_server_gives_prompts_and_metadata_to_a_reward_that_declares_them() -> None:
    with serve_in_thread(_Contextual()) as served:
        res = _remote(served.url).score(
            ["p1", "p2", "x"], ["", "", ""], prompts=["p1", "p2", "p3"], metadata=[{"domain": "math"}, {}, {}]
        )
    assert (res.scores, res.formatted) == ([1.0, 0.0, 0.0], [1.0] * 3)


class _HalfBroken:
    """A code verifier whose sandbox broke on odd rows: those are `failed` (a fallback 0, not a verdict)."""

    def score(self, responses, answers):
        from roll_core.interfaces import RewardResult

        n = len(responses)
        bad = [i % 2 == 1 for i in range(n)]
        ok = [float(r == a and not f) for r, a, f in zip(responses, answers, bad)]
        return RewardResult(ok, ok, [1.0] * n, counters={"sandbox_errors": sum(bad)}, failed=bad)


def test_rows_the_served_reward_could_not_score_arrive_unscored() -> None:
    """The served reward's `failed` flags travel with the reply: those rows are unscored on the client (error_score,
    counted, the guard's failed rows), not wrong answers trained on (the server dropped the flags)."""
    with serve_in_thread(_HalfBroken()) as served:
        reward = _remote(served.url, error_score=-1.0)
        res = reward.score(["a", "b", "c", "d"], ["a", "b", "x", "d"])
        assert res.scores == [1.0, -1.0, 0.0, -1.0] and res.correct == [1.0, 0.0, 0.0, 0.0]
        assert res.failed == [False, True, False, True]
        assert (res.counters["remote_failed"], res.counters["unscored"], res.counters["sandbox_errors"]) == (2, 2, 2)
        assert res.counters["remote_malformed"] == 0 and "could not score" in reward.last_failure
        guarded = GuardedReward(reward, isolation="inline").score(["a", "b"], ["a", "b"])
        assert guarded.counters["failed_unscored"] == guarded.counters["failed_rows"] == 1


class _CountsUnscored:
    """A reward that reports rows it could not score only by its `unscored` counter (no `failed` flags, which the
    guard's contract allows): rows whose answer is "?" (a broken ground truth) score a fallback 0."""

    def __init__(self, flag: bool = False) -> None:
        self.flag = flag  # also mark the rows (a served RemoteReward or GuardedReward does both)

    def score(self, responses, answers):
        from roll_core.interfaces import RewardResult

        ok = [float(r == a) for r, a in zip(responses, answers)]
        failed = [a == "?" for a in answers] if self.flag else None
        return RewardResult(ok, ok, [1.0] * len(ok), counters={"unscored": answers.count("?")}, failed=failed)


def test_the_served_unscored_counter_arrives() -> None:
    """The service's `unscored` count reaches the client's `unscored` (and through it the guard's failed rows)
    even when its reward marked no rows: the client dropped it as a clashing name, so a service failing on every
    row looked like a service grading every answer wrong, and the run never stopped."""
    with serve_in_thread(_CountsUnscored()) as served:
        reward = _remote(served.url, batch_size=2, error_score=-1.0)
        res = reward.score(["a", "b", "c", "d", "e"], ["a", "?", "?", "?", "e"])
        # request 1 (a, ?): one of two unscored, which one unknown: counted, scores kept; request 2 (?, ?): all
        # of them, so both score error_score; request 3 (e): none.
        assert res.scores == [1.0, 0.0, -1.0, -1.0, 1.0] and res.failed == [False, False, True, True, False]
        assert (res.counters["unscored"], res.counters["remote_failed"]) == (3, 3)
        assert "reports 1 of 2 rows unscored" in reward.last_failure
        guarded = GuardedReward(reward, isolation="inline").score(["x", "y"], ["?", "?"])
        assert guarded.counters["failed_unscored"] == guarded.counters["failed_rows"] == guarded.counters["rows"]
    with serve_in_thread(_CountsUnscored(flag=True)) as served:  # rows both marked and counted: counted once
        res = _remote(served.url, batch_size=2, error_score=-1.0).score(["a", "b", "c"], ["a", "?", "c"])
        assert res.scores == [1.0, -1.0, 1.0] and res.failed == [False, True, False]
        assert (res.counters["unscored"], res.counters["remote_failed"]) == (1, 1)


@cache
def _served_countdown() -> RunningServer:
    """The countdown reward served from this process for the conformance suite (one server for its tests)."""
    from roll_envs.tasks.countdown import CountdownReward

    return serve_in_thread(CountdownReward())


class TestRemoteRewardConformance(RewardTestSuite):
    """The reward contract holds through the protocol (malformed responses, lone surrogates, 100k characters)."""

    cases = (
        Case("\\boxed{(1 + 2) * 3}", "9|1,2,3", correct=True),
        Case("\\boxed{9}", "9|1,2,3", correct=False),
        Case("\\boxed{1 + 2 + 3}", "9|1,2,3", correct=False),
    )

    @classmethod
    def build_reward(cls) -> RemoteReward:
        return _remote(_served_countdown().url)
