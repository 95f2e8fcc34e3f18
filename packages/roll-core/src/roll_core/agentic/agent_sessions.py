"""Per-episode token state behind the OpenAI-compatible endpoint: what an agent program's requests sampled, exactly.

An agent program sees chat messages; the trainer needs token ids. A session (one per episode, one id in the URL)
keeps both, token-in-token-out (roll_core.agentic.chat): the ids of the first request's messages up to the
generation header (the prompt), then per turn the ids the engine sampled with their behaviour log-probs (loss
mask 1), and between turns only the ids the chat template adds for the new messages (the end of the assistant turn
the model did not generate, the tool results or user messages, the next generation header; loss mask 0). Earlier
assistant messages are never re-tokenised: a request must repeat the session's conversation so far (the previous
request's messages and the assistant reply the session returned), matched by role, text and tool calls, and only
the messages after it are new.

A request that does not extend the conversation (the agent edited, dropped or summarised earlier messages, or
added an assistant message the model did not sample, which cannot be appended token-in-token-out) is a history
rewrite, counted in `rewrites`. With `on_rewrite="restart"` (default) the session starts its trajectory
again from the rewritten conversation: the whole rewritten history becomes the prompt (mask 0, rendered by the
template) and the turns sampled before it are dropped from training (counted in `dropped_turns`), so every trained
token was sampled in exactly the context the trainer sees. With `on_rewrite="refuse"` the request gets HTTP 400
(code `history_rewritten`) and the session is unchanged.

A turn cut by its token limit (`max_tokens_per_turn`, or the request's own `max_tokens` below it) is counted in
`Trajectory.cut_turns`; one cut short of that limit by the context (its budget was what was left of
`max_context_length`, or the engine stopped it at its own context) in `Trajectory.context_cut_turns` instead.

Limits (`SessionLimits`) stop a session, never the run: a request past `max_turns` gets HTTP 400
(`max_turns_exceeded`), as does every later one, and ends the trajectory there (`end`). A request whose context
leaves no room to generate within `max_context_length` gets HTTP 400 (`context_length_exceeded`) and marks the
trajectory ended there (`end`) unless the agent goes on: a later request that fits (an agent that truncates the
observation that overflowed) is served and clears the mark, since the trajectory did not end at the limit. A turn
whose request constrained decoding (`response_format`) is kept as context with loss mask 0 (counted in
`constrained_turns`): the trainer recomputes log-probs without per-turn constraints, so training on it would use the
wrong distribution.

A client's retry of the previous request (the same messages, tools and settings, sent again because its reply was
not received, after a timeout or a dropped connection) gets the reply the session recorded for it again, counted in
`replays`, instead of a second sample: the turn the agent finally sees is the turn trained on. A retry is what the
client says it is (the server passes `retry=True` for a request whose `x-stainless-retry-count` header, sent by
the openai clients, is 1 or more): a repeated request that is not a retry (an agent asking the same messages again
for another sample) is sampled anew, as any request that does not extend the conversation (a history rewrite,
below). A retry that arrives while the original still runs waits for it and gets its reply. (Without this, the
retry no longer extended the conversation, which now ended in the unseen reply: a history rewrite that dropped the
turns the agent had seen, or a 400 it could not recover from.) Each reply is replayed at most
`MAX_REPLAYS_PER_TURN` times (HTTP 400 `too_many_retries` after that), so a client that retries forever cannot
outlast its turn limit; the cap is per turn, not per episode: a slow engine and an impatient client (every turn a
timeout and its retries, each waiting retry answered) used up an episode-wide cap of `max_turns` within a few turns,
and the agent got a 400 for a turn that was sampled and trained.

A turn request the engine aborts on its own (preemption) is resumed from the tokens it generated, within the turn's
budget (counted in `resumed`), so the agent never sees an engine's abort as the end of its session (a stop string the
aborted attempt began and the resumed one completed ends the turn there, as without the abort:
roll_core.agentic.resume_stops); one the engine aborts `max_idle_aborts` times in a row without a token
(`pipeline.max_idle_aborts`, passed by the agent collector; default `MAX_IDLE_ABORTS`) is refused with HTTP 503
(`engine_aborted`, naming the key), the conversation unchanged. Between those idle aborts the session waits, doubling
from `IDLE_BACKOFF_S` up to `IDLE_BACKOFF_MAX_S` per wait (`idle_backoff_total_s(max_idle_aborts)` in all, about
3.5 s by default), so an engine that refuses for a moment (paused for a weight sync) serves the turn instead of
refusing the agent within milliseconds; closing the session ends the wait at once. Until a later turn is sampled the
trajectory is marked ended there (`end` "abort") and `untrained` (roll_core.agentic.trajectory.to_tensors masks it
out): an agent that gives up on the refusal fails through no fault of the policy, and scoring its turns with the
failure reward trained the engine's refusal as the policy's failure. The 503 carries a Retry-After
(`ABORTED_RETRY_AFTER_S`): the engine may still be paused.

A turn whose engine request raises (the engine failed or was stopped mid-request, or its rank died and restarts
were used up) records nothing of that turn (tokens of a preempted attempt before it included), is counted in
`engine_errors`, and is answered HTTP 500 `engine_error` naming the request and the engine's exception (its
traceback is logged, not sent); a rank that was restarted during the request (`WorkerRestartedError`, transient)
is 503 `engine_restarting` with a Retry-After (`RESTARTING_RETRY_AFTER_S`). Either way the trajectory is marked as
for a refusal (`end` "abort", `untrained`, until a later turn is sampled): an agent that gives up on the engine's
failure was scored the failure reward on its sampled turns.

A template that cannot render a request's messages (its own `raise_exception`) is the request's fault: HTTP 400
`invalid_message`, not a 500 the client retries.

A session that was closed (its episode timed out or ended) answers HTTP 410 (`session_closed`) to its agent's later
requests, a reward report included; `AgentSessions` remembers the last `CLOSED_KEPT` closed ids for that (an id
older than that is unknown: 404). `AgentSessions.abort_all` (the server's close) ends every open session's request
in flight and refuses their later requests (410), leaving them for their episodes to `close`.

Requests that never return. Every engine request goes through a `TurnGate` (roll_core.agentic.turn_gate, "Requests
that never return"): a request aborted by `close` or `abort_all` whose handle has not completed `abort_timeout_s`
(60 s) after the abort (the engine restarted, the abort was lost), or whose result raises, is lost (counted in
`gate.stats()`, warned): its turn is answered 410 `session_closed` as any turn of a closed session. So no endpoint
thread, session lock or process exit waits on an engine that never answers an abort (a blocked thread was one
endpoint thread fewer for the rest of the run). A live request is waited for as long as it runs: the episode's
timeout closes its session, which bounds it.

Thread-safety: one request per session at a time (a second concurrent one gets HTTP 409, unless it is a retry of
the one running, which waits for it); sessions are independent.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from roll_core.agentic._agent_turns import ChatTurn, ParsedReply, Reply  # also importable from here
from roll_core.agentic.agent_messages import (  # noqa: F401 (SessionError, ROLES, normalise_message: re-exported)
    ROLES,
    SessionError,
    message_key,
    normalise_message,
    template_errors,
    template_message,
    turn_key,
)
from roll_core.agentic.resume_stops import split_stop
from roll_core.agentic.trajectory import Trajectory
from roll_core.agentic.turn_gate import ABORT_TIMEOUT_S, GateClosed, TurnGate
from roll_core.idle_aborts import KEY as IDLE_ABORTS_KEY
from roll_core.idle_aborts import (  # noqa: F401 (re-exported)
    MAX_IDLE_ABORTS,
    check_max_idle_aborts,
    idle_backoff_s,
    idle_backoff_total_s,
)
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)

ON_REWRITE = ("restart", "refuse")
#: Retry-After (seconds) of a 503 `engine_aborted`: the session already waited `idle_backoff_total_s(max_idle_aborts)`
#: for the engine.
ABORTED_RETRY_AFTER_S = 1
#: Retry-After (seconds) of a 503 `engine_restarting`: a restarted engine loads its model and gets the weights again.
RESTARTING_RETRY_AFTER_S = 10
#: Closed session ids remembered (to answer 410, not 404): a bounded memory for a run of many episodes.
CLOSED_KEPT = 1 << 16
#: Replays of one recorded reply (module docstring): above any openai client's max_retries in practice.
MAX_REPLAYS_PER_TURN = 32


@dataclass(frozen=True)
class SessionLimits:
    """Where an episode stops regardless of the agent program."""

    max_turns: int = 8
    max_tokens_per_turn: int = 128
    max_context_length: int = 2048


class AgentSession:
    """One episode's conversation and trajectory (see the module docstring)."""

    def __init__(
        self,
        sid: str,
        params: SamplingParams,
        limits: SessionLimits,
        template: Any,
        *,
        group: int = 0,
        index: int = 0,
        on_rewrite: str = "restart",
    ) -> None:
        if on_rewrite not in ON_REWRITE:
            raise ValueError(f"on_rewrite={on_rewrite!r} must be one of {ON_REWRITE}")
        self.sid, self.params, self.limits, self.template = sid, params, limits, template
        self.index, self.on_rewrite = index, on_rewrite
        self.traj = Trajectory(env_seed=index, group=group, prompt_ids=[])
        self.messages: list[dict[str, Any]] = []  # the conversation so far, as the agent must repeat it
        self.tools_key: str | None = None
        self.last_ids: list[int] = []  # the last sampled response (its closing depends on whether it ended in EOS)
        self.reward: float | None = None
        self.requests = 0  # turns sampled, across restarts (what max_turns counts; replays are capped apart)
        self.rewrites = self.dropped_turns = self.constrained_turns = self.invalid_tool_calls = 0
        self.resumed = 0  # turn requests the engine aborted on its own and that were resumed
        self.engine_errors = 0  # turn requests whose engine request raised (500 engine_error / 503 engine_restarting)
        self.closed = False
        self.request_id: str | None = None  # the engine request in flight
        self.woken = threading.Event()  # set on close: ends a wait between a refused turn's tries
        self.lock = threading.Lock()
        # The request being served or last served (turn_key), and the reply recorded for the last one: a retry of
        # it gets that reply again (see the module docstring). `claim` makes taking `lock` and naming the request one
        # step: a retry that came between the two was told 409, as if another request ran.
        self.current_key: str | None = None
        self.claim = threading.Lock()
        self.last_reply: tuple[str, Reply] | None = None
        self.replays = 0  # across the episode (agent/replayed_requests)
        self.turn_replays = 0  # of `last_reply` (what MAX_REPLAYS_PER_TURN caps)

    # ---- one turn -----------------------------------------------------------------------------------------
    def context_for(self, turn: ChatTurn) -> tuple[list[int], list[int], bool]:
        """(context ids for the engine, ids to append to the trajectory first, whether this restarts it);
        raises SessionError for a request the session refuses (see the module docstring)."""
        tools_key = json.dumps(turn.tools, sort_keys=True) if turn.tools else None
        n = len(self.messages)
        extends = (
            n > 0
            and len(turn.messages) > n
            and tools_key == self.tools_key
            and all(message_key(a) == message_key(b) for a, b in zip(self.messages, turn.messages[:n]))
        )
        new = turn.messages[n:]
        # An assistant message the model did not sample cannot be appended token-in-token-out: a fresh trajectory.
        if extends and all(m["role"] != "assistant" for m in new):
            try:
                added = list(
                    self.template.continuation(
                        [template_message(m) for m in new], tools=turn.tools, response_ids=self.last_ids
                    )
                )
            except ValueError as exc:
                raise SessionError(400, "invalid_message", f"session {self.sid}: {exc}") from exc
            return self.traj.context() + added, added, False
        if n > 0:  # a request that does not repeat the conversation so far (or adds an unsampled assistant turn)
            self.rewrites += 1
            if self.on_rewrite == "refuse":
                raise SessionError(
                    400,
                    "history_rewritten",
                    f"session {self.sid}: the messages do not extend the conversation so far (the first "
                    f"{n} messages must repeat the previous request's messages and the assistant reply, unchanged)",
                )
        if not turn.messages:
            raise SessionError(400, "invalid_message", "messages must not be empty")
        try:
            prompt = self.template.initial_messages([template_message(m) for m in turn.messages], tools=turn.tools)
        except Exception as exc:
            # The template refusing these messages (jinja's raise_exception, e.g. "roles must alternate") is the
            # request's fault: it was a 500 that clients retry, and a server error in the log.
            if not isinstance(exc, (ValueError, *template_errors())):
                raise
            raise SessionError(400, "invalid_message", f"session {self.sid}: {type(exc).__name__}: {exc}") from exc
        return list(prompt), [], n > 0

    def record(
        self,
        turn: ChatTurn,
        context: list[int],
        added: list[int],
        restart: bool,
        token_ids: list[int],
        logprobs: list[float],
        finish: str,
        message: dict[str, Any],
    ) -> None:
        """Append one sampled turn (after `added`, or as the first turn of a fresh trajectory)."""
        if restart or not self.messages:
            self.dropped_turns += self.traj.turns
            self.traj = Trajectory(env_seed=self.traj.env_seed, group=self.traj.group, prompt_ids=list(context))
        else:
            self.traj.add_observation(added)
        if turn.structured is not None:  # context only: the trainer cannot replay a per-turn constraint
            self.constrained_turns += 1
            self.traj.add_observation(list(token_ids))
        else:
            self.traj.add_response(list(token_ids), list(logprobs))
        self.traj.turn_rewards.append(0.0)
        # The state the turn acted in, for step-level estimators (GiGPO): the conversation the agent sent.
        state = json.dumps([turn.messages, turn.tools], sort_keys=True, default=str)
        self.traj.state_keys.append(hashlib.blake2b(state.encode(), digest_size=8).hexdigest())
        if finish == "length":  # short of the turn's own limit: the context cut it (what was left, or the engine's)
            limit = min(self.limits.max_tokens_per_turn, turn.max_tokens or self.limits.max_tokens_per_turn)
            by_context = len(token_ids) < limit
            self.traj.context_cut_turns += int(by_context)
            self.traj.cut_turns += int(not by_context)
        self.traj.tool_calls += len(message.get("tool_calls", []))
        self.traj.texts.append(message.get("content") or "")
        self.traj.versions.append(0)
        # A context-limit refusal or an engine refusal (503) the agent recovered from did not end the trajectory.
        self.traj.end, self.traj.untrained = "", False
        self.messages = [*turn.messages, message]
        self.tools_key = json.dumps(turn.tools, sort_keys=True) if turn.tools else None
        self.last_ids = list(token_ids)
        self.requests += 1

    def end_at(self, reason: str, *, untrained: bool = False) -> None:
        """Mark the trajectory ended at a refused request (`reason`); `untrained` when the refusal was the engine's."""
        self.traj.end, self.traj.untrained = reason, untrained

    def set_reward(self, value: Any) -> float:
        """The reward the agent program reports (a finite number; the last report wins)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise SessionError(400, "invalid_reward", f"reward must be a finite number, got {value!r}")
        self.reward = float(value)
        return self.reward

    def finish(self, reward: float, end: str) -> Trajectory:
        """The trajectory with the episode's reward on its last turn (every other turn 0)."""
        traj = self.traj
        if traj.turns:
            traj.turn_rewards[-1] = float(reward)
        traj.end = traj.end or end
        return traj


class AgentSessions:
    """The sessions of a run and the one path from a chat request to an engine request and back (thread-safe).

    `infer` is the inference group's request API (`submit_request`, `abort`); `template` builds token ids from
    messages (`initial_messages(messages, tools=)`, `continuation(messages, tools=, response_ids=)`, `stop_token_ids`,
    and its `tokenizer`, which reads a resumed turn's stop strings: roll_core.agentic.chat.TurnTemplate);
    `parse` turns a response's text into content and tool calls (roll_core.agentic.openai_server.PARSERS);
    `decode` is the tokenizer's decode; `abort_timeout_s` how long an aborted request may take to bring its result
    before it is lost; `max_idle_aborts` (pipeline.max_idle_aborts) the engine's own aborts of a turn request in a
    row, none with a token, that refuse the turn (module docstring).
    """

    def __init__(
        self,
        infer: Any,
        template: Any,
        decode: Callable[[list[int]], str],
        parse: Callable[[str], ParsedReply],
        *,
        on_rewrite: str = "restart",
        abort_timeout_s: float = ABORT_TIMEOUT_S,
        max_idle_aborts: int = MAX_IDLE_ABORTS,
    ) -> None:
        self.infer, self.template, self.decode, self.parse = infer, template, decode, parse
        self.on_rewrite = on_rewrite
        self.max_idle_aborts = check_max_idle_aborts(max_idle_aborts)
        # No syncs here (pipeline=agent is synchronous): the gate only bounds the waits on aborted requests.
        self.gate = TurnGate(infer, partial_rollout=False, abort_timeout_s=abort_timeout_s)
        self._sessions: dict[str, AgentSession] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()  # recently closed ids: their requests get 410
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def open(self, sid: str, params: SamplingParams, limits: SessionLimits, *, group: int = 0, index: int = 0) -> None:
        """Start session `sid` (one episode)."""
        with self._lock:
            if sid in self._sessions:
                raise ValueError(f"session {sid} already exists")
            self._closed.pop(sid, None)
            self._sessions[sid] = AgentSession(
                sid, params, limits, self.template, group=group, index=index, on_rewrite=self.on_rewrite
            )

    def get(self, sid: str) -> AgentSession:
        with self._lock:
            session = self._sessions.get(sid)
            closed = session is None and sid in self._closed
        if closed:  # the agent outlived its episode (timeout): the documented 410, not an unknown session
            raise SessionError(410, "session_closed", f"session {sid} has ended (episode timeout or shutdown)")
        if session is None:
            raise SessionError(
                404, "session_not_found", f"no session {sid!r} (sessions are opened by roll per episode)"
            )
        return session

    def close(self, sid: str) -> AgentSession:
        """Stop session `sid`: later requests get HTTP 410, a request in flight is aborted; returns it."""
        with self._lock:
            session = self._sessions.pop(sid)
            self._closed[sid] = None
            while len(self._closed) > CLOSED_KEPT:
                self._closed.popitem(last=False)
        session.closed = True
        session.woken.set()
        rid = session.request_id
        if rid is not None:
            self.gate.abort(rid)  # its wait is bounded: an engine that never answers the abort holds no thread
        return session

    def abort_all(self) -> None:
        """End every open session's request in flight and refuse its later requests (410): the server is closing,
        and a request left running held a worker thread until the engine answered (forever from a stopped engine, and
        the interpreter joins those threads at exit). The sessions stay open for their episodes to `close`."""
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.closed = True
            session.woken.set()
        self.gate.close()  # aborts every request in flight, their waits bounded; refuses new ones (410)

    def chat(self, sid: str, turn: ChatTurn, *, retry: bool = False) -> Reply:
        """Sample the next assistant turn of session `sid` (blocking; call it off the event loop); a client's retry
        (`retry`) of the previous request gets its recorded reply (see the module docstring)."""
        session = self.get(sid)
        key = turn_key(turn)
        with session.claim:
            waits = not session.lock.acquire(blocking=False)
            if waits and (not retry or key != session.current_key):
                raise SessionError(409, "session_busy", f"session {sid}: another request of this session is running")
            session.current_key = key
        if waits:
            session.lock.acquire()  # a retry of the running request: its reply is this one's
        try:
            # Only a retry is answered again: an agent that repeats a request on purpose wants a new sample (its
            # client does not retry, program= clients never do), and replaying to it looped until the timeout.
            if retry and session.last_reply is not None and session.last_reply[0] == key and not session.closed:
                if session.turn_replays >= MAX_REPLAYS_PER_TURN:  # a client retrying forever: refused, not looped
                    raise SessionError(
                        400,
                        "too_many_retries",
                        f"session {sid}: {session.turn_replays} retries of this request answered, the most per turn",
                    )
                session.replays += 1
                session.turn_replays += 1
                return session.last_reply[1]
            reply = self._chat(session, turn)
            session.last_reply, session.turn_replays = (key, reply), 0
            return reply
        finally:
            session.lock.release()

    def _chat(self, s: AgentSession, turn: ChatTurn) -> Reply:
        if s.closed:
            raise SessionError(410, "session_closed", f"session {s.sid} has ended (episode timeout or shutdown)")
        lim = s.limits
        if s.requests >= lim.max_turns:
            s.end_at("max_turns")
            raise SessionError(
                400, "max_turns_exceeded", f"session {s.sid}: the episode's {lim.max_turns} turns are used"
            )
        context, added, restart = s.context_for(turn)
        room = lim.max_context_length - len(context)
        if room < 1:
            s.end_at("max_context")
            raise SessionError(
                400,
                "context_length_exceeded",
                f"session {s.sid}: {len(context)} context tokens leave no room within {lim.max_context_length}",
            )
        budget = min(lim.max_tokens_per_turn, room, turn.max_tokens or lim.max_tokens_per_turn)
        base = s.params
        seed = None if base.seed is None else derive_seed(base.seed, Purpose.EPISODE_TURN, s.index, s.requests)
        changes: dict[str, Any] = {
            "max_new_tokens": budget,
            "seed": seed,
            "stop": tuple(base.stop) + turn.stop,
            # A template whose turns end on a special token that is not the eos (Gemma 3): stop there too.
            "stop_token_ids": tuple(base.stop_token_ids) + tuple(getattr(self.template, "stop_token_ids", ())),
        }
        if turn.structured is not None:
            changes["structured"] = turn.structured
        token_ids, logprobs, finish = self._generate(s, context, base.replace(**changes))
        if finish == "prompt_too_long":
            s.end_at("max_context")
            raise SessionError(400, "context_length_exceeded", f"session {s.sid}: the engine's context is full")
        if s.closed:
            s.end_at("abort")
            raise SessionError(410, "session_closed", f"session {s.sid} ended while its request ran")
        if finish == "abort":  # the engine refused the request (see `_generate`): the agent may try again
            # Not the policy's failure: untrained unless a later turn is sampled (see the module docstring).
            s.end_at("abort", untrained=True)
            raise SessionError(
                503,
                "engine_aborted",
                f"session {s.sid}: the engine aborted the request and it could not be resumed (aborted "
                f"{self.max_idle_aborts} times in a row without a token, the run's {IDLE_ABORTS_KEY}, or a "
                "constrained turn)",
                kind="server_error",
                retry_after=ABORTED_RETRY_AFTER_S,
            )
        text = self.decode(token_ids)
        stops = (*base.stop, *turn.stop)
        if finish == "stop" and stops:
            # OpenAI's contract: the served text ends before the stop sequence. The engine keeps the completing
            # token (it may overhang the string): the trajectory keeps every token, the message is cut.
            cut = min((i for i in (text.find(x) for x in stops if x) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        parsed = self.parse(text) if turn.parse_tools else ParsedReply(text)
        s.invalid_tool_calls += parsed.invalid
        # Content null without tool calls (a parser's empty reply) is what OpenAI refuses in a history: the agent's
        # next request, repeating it, was a 400 (roll_core.agentic.agent_messages.normalise_message).
        content = "" if parsed.content is None and not parsed.calls else parsed.content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.calls:
            message["tool_calls"] = [
                {"id": f"call_{s.requests}_{k}", "type": "function", "function": dict(c)}
                for k, c in enumerate(parsed.calls)
            ]
        s.record(turn, context, added, restart, token_ids, logprobs, finish, message)
        # A reply cut off by its token budget is "length" even with calls parsed before the cut (OpenAI's
        # precedence): "tool_calls" told the agent its reply was whole while a block after them was cut off.
        reason = "length" if finish == "length" else ("tool_calls" if parsed.calls else "stop")
        return Reply(message, reason, len(context), len(token_ids), list(token_ids), list(logprobs))

    def _generate(
        self, s: AgentSession, context: list[int], params: SamplingParams
    ) -> tuple[list[int], list[float], str]:
        """(token ids, log-probs, finish reason) of one turn. An abort the engine made on its own (preemption) is
        resumed from what it generated, within the turn's budget, instead of ending the episode as if the agent had
        failed; `max_idle_aborts` of them in a row without a token, with a growing wait between them
        (`idle_backoff_s`), are a refusal ("abort"). An abort that left the whole budget generated is "length". A
        stop string of `params.stop` split across the attempts ends the turn at its completing token, "stop", as
        without the abort (roll_core.agentic.resume_stops). A closed session's request is not resumed, nor a
        constrained (`structured`) one that generated tokens."""
        tokens: list[int] = []
        logprobs: list[float] = []
        idle = 0
        for attempt in itertools.count():
            rid = f"{s.sid}-{next(self._ids)}"
            budget = params.max_new_tokens - len(tokens)
            seed = params.seed
            if attempt and seed is not None:
                seed = derive_seed(seed, Purpose.EPISODE_TURN, attempt)
            s.request_id = rid
            try:
                out = self._request(s, Request(rid, context + tokens, params.replace(max_new_tokens=budget, seed=seed)))
            finally:
                s.request_id = None
            earlier = len(tokens)
            tokens += list(out.token_ids)
            logprobs += list(out.logprobs)
            finish = out.finish_reason
            # A stop string the earlier attempts began and this one completed: no engine saw it whole (each reads
            # only its request's new text), so the turn is cut where an unaborted one stopped.
            cut = split_stop(self.template.tokenizer, context, tokens, earlier, params.stop) if params.stop else None
            if cut is not None:
                del tokens[cut:], logprobs[cut:]
                finish = "stop"
            if finish == "abort" and len(tokens) >= params.max_new_tokens:
                finish = "length"
            # A constrained turn cannot go on from a prefix (the engine would start the constraint over after it).
            if finish != "abort" or s.closed or (params.structured is not None and tokens):
                return tokens, logprobs, finish
            idle = 0 if out.token_ids else idle + 1
            if idle >= self.max_idle_aborts:
                log.warning(
                    "session %s: the engine aborted turn request %s %d times in a row without a token: refused "
                    "(503 engine_aborted; an engine that only pauses that often: raise %s)",
                    s.sid,
                    rid,
                    idle,
                    IDLE_ABORTS_KEY,
                )
                return tokens, logprobs, finish
            if idle:
                # Retried at once, an engine paused for a moment (a weight sync) used up every try within
                # milliseconds and the agent got the 503; a close ends the wait (the next try answers 410).
                s.woken.wait(idle_backoff_s(idle))
            s.resumed += 1
        raise AssertionError("unreachable")

    def _request(self, s: AgentSession, req: Request) -> RequestOutput:
        """The output of one engine request of session `s`'s turn, through the gate (module docstring). Raises
        SessionError: 410 when the session closed (before the request, or while it ran and it was then lost), the
        engine's refusal (`_engine_failure`) when it raised."""
        closed = SessionError(410, "session_closed", f"session {s.sid} has ended (episode timeout or shutdown)")
        try:
            # Entered before `s.closed` is read: a close that comes later finds the request running and aborts it.
            self.gate.enter(req.request_id)
        except GateClosed:
            raise closed from None
        try:
            if s.closed:  # closed while this turn was prepared (close() saw no request to abort)
                raise closed
            try:
                # A close during the submit marked the request aborted: the gate's wait sends the abort again.
                out = self.gate.wait(req.request_id, self.infer.submit_request(req, route_key=s.sid))
            except Exception as exc:  # the tokens of earlier attempts are dropped with the turn
                raise _engine_failure(s, req.request_id, exc) from exc
        finally:
            self.gate.leave(req.request_id)
        if out is None:  # aborted by a close and lost (no result in abort_timeout_s, or it raised): as `_chat`
            s.end_at("abort")
            raise SessionError(410, "session_closed", f"session {s.sid} ended while its request ran")
        return out

    def sessions(self) -> Sequence[str]:
        with self._lock:
            return list(self._sessions)


def _engine_failure(s: AgentSession, rid: str, exc: Exception) -> SessionError:
    """The refusal of a turn whose engine request `rid` raised `exc` (see the module docstring); the session is
    marked."""
    if s.closed:  # the episode ended while the request ran (its abort may have failed the request): as `_chat`
        s.end_at("abort")
        return SessionError(410, "session_closed", f"session {s.sid} ended while its request ran")
    s.end_at("abort", untrained=True)  # not the policy's failure: untrained unless a later turn is sampled
    s.engine_errors += 1
    log.warning("session %s: the inference engine failed during turn request %s", s.sid, rid, exc_info=exc)
    # The first line only, capped: a worker's death quotes Ray's report of it (a traceback), which stays in the log.
    lines = str(exc).strip().splitlines()
    what = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")
    from roll_core.cluster.group import WorkerRestartedError  # lazily: the sessions need no cluster otherwise

    if isinstance(exc, WorkerRestartedError):
        return SessionError(
            503,
            "engine_restarting",
            f"session {s.sid}: the inference engine was restarted during request {rid}; try again ({what})",
            kind="server_error",
            retry_after=RESTARTING_RETRY_AFTER_S,
        )
    return SessionError(
        500,
        "engine_error",
        f"session {s.sid}: the inference engine failed during request {rid} ({what})",
        kind="server_error",
    )
