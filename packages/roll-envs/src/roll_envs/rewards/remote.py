"""A reward scored by an HTTP verifier service (`env/reward=remote env.reward.url=http://host:8000/score`).

Protocol (JSON over HTTP POST to `url`; `roll_envs.rewards.serve` is a reference server for any roll reward):
- request: `{"rows": [{"response": str, "answer": str, "prompt": str | null, "metadata": {...}}, ...]}`, at most
  `batch_size` rows per request (a `score` call of more rows sends several requests, at most `max_concurrency` in
  flight at once). `prompt` is the problem's prompt text, `metadata` the row's metadata (its `domain` and every
  other column of its data row; values JSON cannot hold are sent as their `str()`).
- reply (status 200): `{"rows": [{"score": float, "correct"?: 0|1, "formatted"?: 0|1, "failed"?: bool}, ...]}`, one
  row per request row in the same order; a row may also be a bare number, and the whole reply a bare list of
  numbers (`[0.5, 1.0]`). A row without `correct` is correct when its score >= `correct_threshold`; without
  `formatted` it is formatted when it is correct. `"failed": true` says the service's reward could not score the
  row (its score is a fallback, not a verdict: a code verifier whose sandbox broke, a malformed ground truth). An
  optional `"counters": {"name": int}` adds the service's own failure counts (a math verifier's `timeouts`, a code
  verifier's `sandbox_errors`) to the result's counters, except the client's own names (COUNTERS), which are
  ignored; but the service's `unscored` (rows its reward could not score, which a reward may report without
  marking the rows) is kept: a reply whose `unscored` exceeds the rows it marks `failed` or that are malformed has
  that many more rows counted in `unscored` and `remote_failed` (their scores stay the service's fallbacks, as
  which rows they are is not known; when they are all the reply's remaining rows, those score `error_score`).
  Behind roll-core's reward guard such a batch is scored again row by row, where each reply's count names its
  row (the guard never counts a failed row it cannot flag): a service that marks its failed rows saves that cost.
  A reply body is read up to `MAX_REPLY_BYTES` (the scores of a batch take kilobytes): a longer one is malformed
  (its rows counted, not retried) and read no further, so a broken service cannot fill the reward worker's memory.

Failures are counted rows, never an exception out of `score`. A failed row scores `error_score`, with
correct = formatted = 0, counts in `unscored` (roll-core's reward guard counts those rows in `failed_rows`, so a
dead or refusing service, which fails every row, stops the run after `pipeline.max_reward_failure_steps` steps
through its RewardFailureBudget, instead of training on `error_score` forever), and in one of (counts of rows,
except `remote_retries`):
- `remote_timeouts`: its request got no answer within `timeout_s`, on every try;
- `remote_errors`: connection errors, an HTTP status other than 200 (the last try's), or anything else that broke a
  request (rows JSON cannot encode, such as metadata keyed by tuples; a reply nested too deep to decode); a
  301/302/303 redirect (aiohttp follows it with a GET, without the rows: whatever answered that was no verdict on
  them; 307/308 keep the POST and are followed), not retried;
- `remote_malformed`: a reply that is not JSON or has the wrong number of rows (every row of the request), or a
  row whose score is missing, not a number or not finite, whose `correct`/`formatted` is not 0/1 or whose
  `failed` is not a JSON boolean (that row);
- `remote_failed`: a row the reply marks `"failed": true`, or counts in its `unscored` (the service's counters say why);
- `remote_retries`: requests sent again. Connection errors, timeouts, 429 and 5xx are retried up to `max_retries`
  times, after `backoff_s * 2**try` seconds (+-50% jitter, at most `max_backoff_s`) or the reply's Retry-After
  (seconds, at most `max_backoff_s`); any other status and malformed replies are not retried.
Worst case of one `score` call: ceil(requests / max_concurrency) x (max_retries + 1) x (timeout_s + max_backoff_s).

Where it runs: inside a reward worker, maybe in a forked child (GuardedReward's process isolation), maybe off the
main thread. Each `score` call runs its own event loop and HTTP session, made and closed within the call (a loop
or session never crosses a fork or a thread); a call from a thread whose event loop is running is served by a
short-lived helper thread. The API key is read from the environment variable named by `api_key_env` (never put
the key in the config) and sent as `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

from omegaconf import MISSING

from roll_core.errors import ConfigError, Extra
from roll_envs.rewards.base import Reward, RewardResult

log = logging.getLogger(__name__)

AIOHTTP = Extra("aiohttp", "env/reward=remote (an HTTP verifier service)", "aiohttp", "roll-envs[remote]")
#: Counters every result carries (0 when nothing failed), so the metrics are continuous.
COUNTERS = ("remote_timeouts", "remote_errors", "remote_malformed", "remote_failed", "remote_retries", "unscored")
#: Statuses worth another try besides 5xx (429: rate limited).
_RETRY_STATUSES = {429}
#: Characters of a failed reply's body kept in the log line.
_EXCERPT = 200
#: Longest reply body read, bytes (module docstring); the LLM judge's backend reads its replies with the same cap.
MAX_REPLY_BYTES = 64 * 1024 * 1024


@dataclass
class RemoteRewardConfig:
    """An HTTP verifier service scores the responses (protocol: roll_envs.rewards.remote)."""

    _target_: str = "roll_envs.rewards.remote.RemoteReward"
    # The service's scoring endpoint, e.g. http://verifier:8000/score.
    url: str = MISSING
    # Rows per request.
    batch_size: int = 16
    # Requests in flight at once (per reward worker).
    max_concurrency: int = 8
    # Seconds one request may take (connect + reply).
    timeout_s: float = 30.0
    # Further tries of a request after a connection error, a timeout, 429 or 5xx.
    max_retries: int = 3
    # First retry's wait, seconds; doubles each try (with jitter).
    backoff_s: float = 1.0
    # Longest wait between tries, seconds (also caps a reply's Retry-After).
    max_backoff_s: float = 30.0
    # Score of a row the service failed to score.
    error_score: float = 0.0
    # A row whose reply has no `correct` is correct when its score >= this.
    correct_threshold: float = 1.0
    # NAME of the environment variable holding the API key (sent as a Bearer token); null: no key.
    api_key_env: str | None = None
    # Extra HTTP headers of every request.
    headers: dict[str, str] = field(default_factory=dict)

    def check_installed(self) -> None:
        AIOHTTP.require()


class _Failed(Exception):
    """A request that failed for good: `kind` is the counter of its rows."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RemoteReward(Reward):
    """Scores from an HTTP verifier service; every failure is a counted row (see the module docstring)."""

    def __init__(
        self,
        url: str,
        batch_size: int = 16,
        max_concurrency: int = 8,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        error_score: float = 0.0,
        correct_threshold: float = 1.0,
        api_key_env: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        AIOHTTP.require()
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"env.reward.url={url!r} must be an http:// or https:// URL of the verifier service")
        for key, value in (("batch_size", batch_size), ("max_concurrency", max_concurrency)):
            if value < 1:
                raise ConfigError(f"env.reward.{key}={value} must be >= 1")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ConfigError(
                f"env.reward: timeout_s={timeout_s} must be > 0, and max_retries={max_retries}, "
                f"backoff_s={backoff_s}, max_backoff_s={max_backoff_s} >= 0"
            )
        if not math.isfinite(error_score):
            raise ConfigError(f"env.reward.error_score={error_score} must be a finite number")
        self.url, self.batch_size, self.max_concurrency = url, batch_size, max_concurrency
        self.timeout_s, self.max_retries = float(timeout_s), max_retries
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.error_score, self.correct_threshold = float(error_score), float(correct_threshold)
        if any(k.lower() == "authorization" for k in headers or {}):
            # A key written in the config lands in logs, checkpoints and trackers' config dumps.
            raise ConfigError(
                "env.reward.headers: do not put the API key (Authorization) in the config; export it and name the "
                "variable: env.reward.api_key_env=MY_VERIFIER_KEY"
            )
        self.headers = {"Content-Type": "application/json", **dict(headers or {})}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ConfigError(
                    f"env.reward.api_key_env={api_key_env}: the environment variable {api_key_env} is not set (or "
                    "empty) in the reward worker's environment; export it there, or set api_key_env=null"
                )
            self.headers["Authorization"] = f"Bearer {key}"
        self._logged: set[str] = set()
        #: The first failure of the latest `score()` call, as one line (None: nothing failed).
        self.last_failure: str | None = None

    # -- the reward ---------------------------------------------------------------------------------------------

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[Mapping[str, Any]] | None = None,
        time_budget_s: float | None = None,
    ) -> RewardResult:
        """Scores of `responses[i]` against `answers[i]` from the service, `prompts[i]` and `metadata[i]` sent
        along; never raises for anything the service does (failed rows are counted, see the module docstring).
        `time_budget_s` (roll's reward guard gives it): requests not answered by then are given up, their rows
        counted in `remote_timeouts` and `unscored`, and the finished ones kept (the guard's cut-off after its
        batch timeout lost every finished request's scores)."""
        n = len(responses)
        for name, rows in (("answers", answers), ("prompts", prompts), ("metadata", metadata)):
            if rows is not None and len(rows) != n:
                raise ValueError(f"{n} responses but {len(rows)} {name}")
        rows = [
            {
                "response": str(responses[i]),
                "answer": str(answers[i]),
                "prompt": None if prompts is None else str(prompts[i]),
                "metadata": {} if metadata is None else dict(metadata[i]),
            }
            for i in range(n)
        ]
        self.last_failure = None
        counters = dict.fromkeys(COUNTERS, 0)
        if n == 0:
            return RewardResult(scores=[], correct=[], formatted=[], counters=counters)
        results = _run(self._score_all(rows, counters, time_budget_s))
        scores, correct, formatted = [], [], []
        for row in results:
            counters["unscored"] += row is None  # the guard's failed rows (roll_core.cluster.reward_guard)
            s, c, f = row if row is not None else (self.error_score, 0.0, 0.0)
            scores.append(s)
            correct.append(c)
            formatted.append(f)
        return RewardResult(
            scores=scores,
            correct=correct,
            formatted=formatted,
            counters=counters,
            failed=[row is None for row in results],  # the rows scored error_score without a verdict
        )

    # -- requests -----------------------------------------------------------------------------------------------

    async def _score_all(
        self, rows: list[dict[str, Any]], counters: dict[str, int], budget: float | None = None
    ) -> list[Any]:
        import aiohttp

        results: list[Any] = [None] * len(rows)
        limit = asyncio.Semaphore(self.max_concurrency)
        # The semaphore alone bounds the requests in flight: a connector limit would make a request wait for a
        # connection inside its own timeout. The session lives for this call only (see the module docstring).
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, headers=self.headers) as session:

            async def one(start: int) -> None:
                batch = rows[start : start + self.batch_size]
                async with limit:
                    try:
                        body = await self._request(session, batch, counters)
                        parsed = self._parse(body, len(batch), counters)
                    except _Failed as exc:
                        counters[exc.kind] += len(batch)
                        self._fail(exc.kind, f"rows {start}..{start + len(batch) - 1}: {exc}")
                        return
                    except Exception as exc:  # unforeseen: its rows were left unscored with no counter
                        counters["remote_errors"] += len(batch)
                        where = f"rows {start}..{start + len(batch) - 1}"
                        self._fail("remote_errors", f"{where}: {type(exc).__name__}: {str(exc)[:_EXCERPT]}")
                        return
                results[start : start + len(batch)] = parsed

            starts = range(0, len(rows), self.batch_size)
            tasks = {asyncio.ensure_future(one(s)): s for s in starts}
            _, pending = await asyncio.wait(tasks, timeout=budget)
            for task in pending:  # out of time: give these requests up, keep what the others scored
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in pending:
                start = tasks[task]
                size = len(rows[start : start + self.batch_size])
                counters["remote_timeouts"] += size
                self._fail(
                    "remote_timeouts",
                    f"rows {start}..{start + size - 1}: not scored within the call's "
                    f"time budget of {budget:.3g}s (pipeline.reward_batch_timeout_s)",
                )
        return results

    async def _request(self, session: Any, batch: list[dict[str, Any]], counters: dict[str, int]) -> str:
        """The reply body of one request (status 200), after retries; raises `_Failed` when every try failed."""
        import aiohttp

        payload = json.dumps({"rows": batch}, default=str)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        attempt = 0
        while True:
            retry_after: float | None = None
            try:
                async with session.post(self.url, data=payload, timeout=timeout) as resp:
                    moved = redirected(self.url, resp)
                    if moved is not None:
                        raise _Failed("remote_errors", moved)
                    text = await read_reply(resp)
                    if text is None:  # a service that sends that much will again: not retried
                        raise _Failed("remote_malformed", f"HTTP {resp.status} reply over {MAX_REPLY_BYTES} bytes")
                    if resp.status == 200:
                        return text
                    failure = _Failed("remote_errors", f"HTTP {resp.status} from {self.url}: {text[:_EXCERPT]!r}")
                    retryable = resp.status in _RETRY_STATUSES or resp.status >= 500
                    retry_after = _retry_after(resp.headers.get("Retry-After"))
            except asyncio.TimeoutError:
                failure = _Failed("remote_timeouts", f"no reply from {self.url} within {self.timeout_s}s")
                retryable = True
            except aiohttp.ClientError as exc:
                failure = _Failed("remote_errors", f"{type(exc).__name__} from {self.url}: {exc}")
                retryable = True
            if not retryable or attempt >= self.max_retries:
                if attempt:
                    failure.args = (f"{failure} (after {attempt} retries)",)
                raise failure
            wait = self.backoff_s * 2**attempt * random.uniform(0.5, 1.5) if retry_after is None else retry_after
            attempt += 1
            counters["remote_retries"] += 1
            await asyncio.sleep(min(wait, self.max_backoff_s))

    def _parse(self, body: str, expected: int, counters: dict[str, int]) -> list[tuple[float, float, float] | None]:
        """(score, correct, formatted) per row of a reply, None for a malformed row (counted); raises `_Failed`
        when the reply as a whole is malformed."""
        try:
            reply = json.loads(body)
        except ValueError:
            raise _Failed("remote_malformed", f"reply is not JSON: {body[:_EXCERPT]!r}") from None
        rows = reply.get("rows") if isinstance(reply, dict) else reply
        if not isinstance(rows, list):
            raise _Failed("remote_malformed", f'reply has no "rows" list: {body[:_EXCERPT]!r}')
        if len(rows) != expected:
            raise _Failed("remote_malformed", f"reply has {len(rows)} rows for {expected} sent")
        served_unscored = self._add_counters(reply.get("counters"), counters) if isinstance(reply, dict) else 0
        out: list[tuple[float, float, float] | None] = []
        for i, row in enumerate(rows):
            flag = row.get("failed") if isinstance(row, dict) else None
            if flag is not None and not isinstance(flag, bool):  # `"failed": "true"` or 1 was scored as a verdict
                counters["remote_malformed"] += 1
                self._fail("remote_malformed", f"reply row {i}: failed={flag!r} is not true or false")
                out.append(None)
                continue
            if flag is True:  # the service's reward could not score it
                counters["remote_failed"] += 1
                self._fail("remote_failed", f"reply row {i}: the service could not score it (see its counters)")
                out.append(None)
                continue
            try:
                out.append(self._row(row))
            except (ValueError, OverflowError) as exc:  # OverflowError: an integer too large for a float
                counters["remote_malformed"] += 1
                self._fail("remote_malformed", f"reply row {i}: {exc}")
                out.append(None)
        scored = [i for i, row in enumerate(out) if row is not None]
        extra = min(served_unscored - (len(out) - len(scored)), len(scored))
        if extra > 0:  # the service counted unscored rows it did not mark (module docstring)
            counters["remote_failed"] += extra
            self._fail("remote_failed", f"the service reports {served_unscored} of {expected} rows unscored")
            if extra == len(scored):
                for i in scored:
                    out[i] = None  # counted in `unscored` by score()
            else:
                counters["unscored"] += extra
        return out

    def _row(self, row: Any) -> tuple[float, float, float]:
        fields = row if isinstance(row, dict) else {"score": row}
        score = fields.get("score")
        if not _is_number(score) or not math.isfinite(score):
            raise ValueError(f"score {score!r} is not a finite number")
        correct = fields.get("correct")
        if correct is None:
            correct = float(score >= self.correct_threshold)
        elif not _is_number(correct) or correct not in (0, 1):
            raise ValueError(f"correct={correct!r} is not 0 or 1")
        formatted = fields.get("formatted", correct)
        if not _is_number(formatted) or formatted not in (0, 1):
            raise ValueError(f"formatted={formatted!r} is not 0 or 1")
        return float(score), float(correct), float(formatted)

    def _add_counters(self, extra: Any, counters: dict[str, int]) -> int:
        """Add a reply's counters to `counters` (module docstring); returns its `unscored` (0 without one)."""
        if extra is None:
            return 0
        if not isinstance(extra, dict):
            self._fail("counters", f'reply "counters" is not an object: {extra!r} (ignored)', count=False)
            return 0
        unscored = 0
        for key, value in extra.items():
            valid = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if valid and key == "unscored":
                unscored = value
            elif valid and key not in COUNTERS:
                counters[key] = counters.get(key, 0) + value
            else:
                self._fail("counters", f'reply counter "{key}": {value!r} ignored', count=False)
        return unscored

    def _fail(self, kind: str, message: str, count: bool = True) -> None:
        """Note a failure: the first of the call is `last_failure`, the first of each kind is logged."""
        if count and self.last_failure is None:
            self.last_failure = f"{kind}: {message}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("remote reward %s: %s (later %s failures are only counted)", self.url, message, kind)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError):
        return None


def redirected(url: str, resp: Any) -> str | None:
    """Why the aiohttp response `resp` to a POST to `url` answers no POST: a 301/302/303 redirect that aiohttp
    followed with a GET, without the body (None when the POST arrived)."""
    if resp.method == "POST":
        return None
    hops = ", ".join(f"{h.status} to {h.headers.get('Location')}" for h in resp.history)
    return (
        f"{url} redirected ({hops}) and the POST became a GET without its body: set the URL to the address that "
        "answers the POST"
    )


async def read_reply(resp: Any) -> str | None:
    """An aiohttp response's body as text (its charset, else UTF-8; bytes it cannot decode replaced), or None when
    it is longer than `MAX_REPLY_BYTES`, read no further (aiohttp's `text()` read any length into memory: 200 MB of
    reply took 600 MB)."""
    import codecs

    limit = MAX_REPLY_BYTES
    if resp.content_length is not None and resp.content_length > limit:
        return None
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            return None
    try:
        encoding = codecs.lookup(resp.charset or "utf-8").name
    except LookupError:  # an unknown charset: UTF-8, as aiohttp reads it
        encoding = "utf-8"
    return bytes(body).decode(encoding, errors="replace")


def _run(coro: Any) -> Any:
    """Run `coro` to completion in a private event loop (in a helper thread when this thread's loop is running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = _run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="remote-reward", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
