"""An OpenAI-compatible chat-completions endpoint in front of roll's rollout engines, one session per episode.

Routes (aiohttp, bound to 127.0.0.1 unless told otherwise; port 0 picks a free one):

    POST /sessions/{sid}/v1/chat/completions   the next assistant turn of episode `sid`
    GET  /sessions/{sid}/v1/models             the served model (404 / 410 as chat for an unknown / ended session;
                                               also GET /v1/models)
    POST /sessions/{sid}/reward                {"reward": <number>}: the episode's reward (the last report wins)

An agent program uses `openai.OpenAI(base_url=server.base_url(sid), api_key=...)` unmodified (the key is not
checked: the server only listens locally and sessions are opened by roll). Token state, history matching and
limits are the session's (roll_core.agentic.agent_sessions); this module validates requests and speaks the wire
format:

- Errors are OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, with 400 for a request the
  endpoint refuses, 404 for an unknown session or route, 405 for a method a route does not take, 409 for a second
  concurrent request of one session, 410 for a session that ended (the episode timed out), 413 for a body over
  `max_body_bytes`, 503 (`engine_aborted`) for a turn the engine keeps aborting (its own aborts are resumed first:
  roll_core.agentic.agent_sessions) and 503 (`engine_restarting`) for one whose engine rank was restarted under it,
  both with a Retry-After header, 500 (`engine_error`, type `server_error`) for a turn whose engine request raised
  (the message names the engine's exception; its traceback is logged), 500 (`internal_error`) for a bug (logged).
  A refusal never stops the run.
- A client's retry (header `x-stainless-retry-count` >= 1, as the openai clients send it) of the previous request
  gets the reply recorded for it again; any other request is sampled (roll_core.agentic.agent_sessions).
- Sampling follows the run (infer_engine.temperature, top_p, top_k): the trainer's ratio assumes that distribution,
  so a request's temperature / top_p / seed are ignored (but must be what OpenAI takes: numbers in range, else
  400); what would change the distribution the trainer replays (presence / frequency penalties, logit_bias,
  logprobs, n > 1, tool_choice other than auto / none) is refused, as are the legacy `functions` (the model would
  never see them: use `tools`). vLLM's request extensions (what an agent written for a vLLM server sends in
  `extra_body`) are refused the same way where they would change the reply: decoding constraints (`guided_*`,
  `structured_outputs`: use `response_format`), `stop_token_ids`, `min_tokens`, `ignore_eos`, `bad_words`,
  `allowed_token_ids`, `repetition_penalty` other than 1, beam search (they were ignored: a 200 whose reply the
  agent took for constrained, or stopped where it asked); its `top_k` / `min_p` are ignored as temperature is.
- A message's `content` is a string or a list of text parts, joined by newlines as vLLM's OpenAI server joins them
  (roll_core.agentic.agent_sessions.normalise_message); other parts (images, audio) are refused.
- `max_completion_tokens` (else `max_tokens`) and `stop` are honoured within the session's limits.
- `response_format` json_object / json_schema becomes a decoding constraint (roll_core.interfaces.StructuredOutput)
  when the engine supports one (`check_sampling`), else 400 `unsupported_response_format`.
- Tool calls: the request's `tools` go to the chat template; the response text is parsed by the model family's
  tool-call parser (`PARSERS`, roll_core.agentic._tool_calls: `hermes` for Qwen / Hermes
  `<tool_call>{json}</tool_call>`, `none`, or a `module:Class` of your own) into OpenAI `tool_calls` (finish_reason
  `tool_calls`, or `length` when the reply was cut off by its token budget, calls or not). A block that does not
  parse (hermes: not JSON, no name, or arguments that are not a JSON object) is left in the content and counted on
  the session, as is an unclosed `<tool_call>`; blocks inside `<think>` reasoning are no calls. A call names the
  function the model wrote, one the request did not offer included (the agent answers it, as under vLLM).
  `tool_choice` "none" leaves the reply's tool-call syntax in the content (the tools still reach the template, as
  vLLM does); "required" and a named function are refused (400: nothing would force the call). A tool message
  must answer a call of the assistant message it follows (its `tool_call_id`), else 400 as OpenAI answers. The
  reply is decoded without special tokens but with the parser's `markers` (`text_decoder`: some tokenizers mark
  `<tool_call>` special). The trajectory keeps the sampled ids, never a re-rendering of the parsed calls; the
  agent's echo of a reply matches it with the arguments compared as JSON values (spacing and key order free).
- `stream=true` (a JSON boolean) is answered as server-sent events in OpenAI's chunk format (the whole turn is
  generated first, then sent as a role/content chunk, a tool-calls chunk and a final chunk, then `data: [DONE]`;
  with `stream_options.include_usage` a usage chunk precedes it; `stream_options` without `stream=true`, or an
  `include_usage` that is not a JSON boolean, is a 400 as OpenAI answers it). A client that leaves before the
  stream is sent does not undo the turn: it stays recorded, and the client's retry gets it.
- `close()` ends the requests in flight (roll_core.agentic.agent_sessions.AgentSessions.abort_all) before it stops.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from roll_core.agentic._tool_calls import (  # noqa: F401 (re-exported: the parsers' public home is this module)
    PARSERS,
    HermesToolParser,
    NoToolParser,
    text_decoder,
    tool_parser,
)
from roll_core.agentic.agent_messages import check_tool_results
from roll_core.agentic.agent_sessions import (
    AgentSessions,
    ChatTurn,
    Reply,
    SessionError,
    normalise_message,
)
from roll_core.errors import Extra

log = logging.getLogger(__name__)

#: Distinct response_format constraints whose engine verdict is remembered (least recently used dropped first).
MAX_CHECKED_FORMATS = 1024

AIOHTTP = Extra("aiohttp", "pipeline=agent (the OpenAI-compatible endpoint)", "aiohttp", "roll-core[agents]")


# ---- request validation ---------------------------------------------------------------------------------------
_REFUSED = {
    "logprobs": "log-probs in responses",
    "top_logprobs": "log-probs in responses",
    "logit_bias": "logit_bias (it changes the sampled distribution the trainer replays)",
    "presence_penalty": "presence_penalty (it changes the sampled distribution the trainer replays)",
    "frequency_penalty": "frequency_penalty (it changes the sampled distribution the trainer replays)",
    # Legacy function calling: the functions went nowhere (the model never saw them, the agent got plain text).
    "functions": "the legacy functions field (send them as tools)",
    # vLLM's extensions (module docstring): each was a 200 that had silently not done what it asks.
    **dict.fromkeys(
        ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
        "vLLM's guided decoding (send a decoding constraint as response_format)",
    ),
    **dict.fromkeys(
        ("stop_token_ids", "min_tokens", "ignore_eos", "bad_words", "allowed_token_ids", "logits_processors"),
        "this vLLM extension (send stop strings as stop; the run decides the rest)",
    ),
    "repetition_penalty": "repetition_penalty (it changes the sampled distribution the trainer replays)",
    "use_beam_search": "beam search (the trainer replays sampled turns)",
    "best_of": "best_of (one sample per request)",
    "prompt_logprobs": "log-probs in responses",
}
#: The value of a `_REFUSED` field that asks for nothing beyond a falsy one (vLLM's defaults): accepted.
_NEUTRAL = {"repetition_penalty": 1, "best_of": 1}
#: Sampling fields a request may send but the run decides (see the module docstring): checked as OpenAI checks them.
_IGNORED_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def chat_turn(body: Any) -> ChatTurn:
    """A chat-completions body as a ChatTurn; raises SessionError (400) naming the field it refuses."""
    if not isinstance(body, dict):
        raise SessionError(400, "invalid_json", "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SessionError(400, "invalid_message", "messages must be a non-empty list")
    for key, what in _REFUSED.items():
        value = body.get(key)
        if value and value != _NEUTRAL.get(key):
            raise SessionError(400, "unsupported_parameter", f"{key}: this endpoint does not support {what}")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise SessionError(400, "unsupported_parameter", "n: one choice per request (one episode, one trajectory)")
    # Ignored, yet a malformed value is a malformed request: it was answered 200 (OpenAI answers 400).
    for key, (low, high) in _IGNORED_RANGES.items():
        value = body.get(key)
        if value is not None and not (_number(value) and low <= value <= high):
            raise SessionError(400, "invalid_parameter", f"{key}={value!r} must be a number in [{low:g}, {high:g}]")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise SessionError(400, "invalid_parameter", f"seed={seed!r} must be an integer")
    tools = body.get("tools")
    if tools is not None:
        ok = isinstance(tools, list) and all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            and t["function"]["name"]
            # A schema that is no object ("parameters": "x") reached the template as is (OpenAI answers 400).
            and isinstance(t["function"].get("parameters", {}), (dict, type(None)))
            and isinstance(t["function"].get("description", ""), (str, type(None)))
            for t in tools
        )
        if not ok:  # a function without a name reached the template, and the model was offered a tool it cannot call
            raise SessionError(
                400,
                "invalid_tools",
                'tools must be a list of {"type": "function", "function": {"name": ..., "description"?: str, '
                '"parameters"?: {JSON schema object}}}',
            )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise SessionError(400, "unsupported_parameter", f"tool_choice={choice!r}: only auto and none are supported")
    # max_completion_tokens is the newer name; clients that serialise every field send it as null beside max_tokens.
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise SessionError(400, "invalid_parameter", f"max_tokens={max_tokens!r} must be a positive integer")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):  # a number was a 500 (tuple(5)), which clients retry
        raise SessionError(400, "invalid_parameter", "stop must be a string or a list of non-empty strings")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise SessionError(400, "invalid_parameter", "stop must be a string or a list of non-empty strings")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):  # "false" (a string) was truthy: a stream unasked for
        raise SessionError(400, "invalid_parameter", f"stream={stream!r} must be true or false (a JSON boolean)")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):  # read after the turn is generated: check it before
        raise SessionError(400, "invalid_parameter", "stream_options must be an object ({include_usage: bool})")
    if options is not None and not stream:  # OpenAI answers 400: the options of a stream that was not asked for
        raise SessionError(400, "invalid_parameter", "stream_options: only allowed when stream is true")
    usage = (options or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):  # "false" (a string) was truthy: a usage chunk unasked for
        raise SessionError(
            400, "invalid_parameter", f"stream_options.include_usage={usage!r} must be true or false (a JSON boolean)"
        )
    normalised = [normalise_message(m, i) for i, m in enumerate(messages)]
    check_tool_results(normalised)
    return ChatTurn(
        messages=normalised,
        tools=tools or None,
        max_tokens=max_tokens,
        stop=stops,
        structured=_structured(body.get("response_format")),
        # Tool calls are parsed only where tools were offered (as OpenAI and vLLM do): a plain chat whose reply
        # holds the parser's syntax keeps its text.
        parse_tools=bool(tools) and choice != "none",
    )


def _structured(fmt: Any) -> Any:
    """The decoding constraint of a response_format (None for text or none)."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    from roll_core.interfaces.inference import StructuredOutput

    kind = fmt.get("type") if isinstance(fmt, dict) else None
    try:
        if kind == "json_object":
            return StructuredOutput(json_schema={"type": "object"})
        if kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            # OpenAI's schema is optional: null (clients that send every field) is a left-out one, not a 400.
            schema = fmt["json_schema"].get("schema")
            return StructuredOutput(json_schema={} if schema is None else schema)
    except ValueError as exc:
        raise SessionError(400, "invalid_response_format", str(exc)) from exc
    raise SessionError(400, "invalid_response_format", f"response_format={fmt!r}: text, json_object or json_schema")


def _error(
    status: int, code: str, message: str, kind: str = "invalid_request_error", retry_after: int | None = None
) -> Any:
    from aiohttp import web

    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    # The openai clients wait what Retry-After says (up to a minute) before their retry of a 503.
    headers = {"Retry-After": str(int(retry_after))} if retry_after is not None else None
    return web.json_response(body, status=status, headers=headers)


def _refused(exc: SessionError) -> Any:
    return _error(exc.status, exc.code, exc.message, exc.kind, exc.retry_after)


def is_retry(headers: Any) -> bool:
    """Whether a request is a client's retry: the openai clients (Python, Node) send `x-stainless-retry-count`, 0 on
    the first attempt; a request without it is a first attempt."""
    try:
        return int(headers.get("x-stainless-retry-count", "0")) >= 1
    except (TypeError, ValueError):
        return False


_ROUTES = "POST /sessions/{sid}/v1/chat/completions, GET /sessions/{sid}/v1/models, POST /sessions/{sid}/reward"
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


async def _openai_errors(request: Any, handler: Any) -> Any:
    """aiohttp's own refusals (unknown route, wrong method, body too large) and a handler's bug (500
    `internal_error`, logged) in OpenAI's error JSON: clients parse `error.message` / `error.code` and showed
    aiohttp's plain text as an unreadable error."""
    from aiohttp import web

    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason}"
        if exc.status == 404:
            message += f" (this endpoint serves {_ROUTES})"
        resp = _error(exc.status, _HTTP_CODES.get(exc.status, "http_error"), message)
        if isinstance(exc, web.HTTPMethodNotAllowed):
            resp.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        return resp
    except Exception as exc:  # a bug in a handler: aiohttp answered it in plain text ("Server got itself in trouble")
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}", "server_error")


# ---- the server -------------------------------------------------------------------------------------------------
class OpenAIServer:
    """The endpoint on its own event loop thread (see the module docstring). `start()` returns the root URL."""

    def __init__(
        self,
        sessions: AgentSessions,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "roll",
        max_workers: int = 256,
        max_body_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        AIOHTTP.require()
        self.sessions, self.host, self.port, self.model_name = sessions, host, port, model_name
        self.max_body_bytes = max_body_bytes
        # Engine requests block until their turn is generated: one thread per running request. Requests beyond
        # `max_workers` wait for a thread before they reach the engine: size it to the episodes that run at once (the
        # agent collector does).
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="roll-openai")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None
        # Engine verdicts on response_format constraints, most recently used last: bounded, as agents may send a new
        # schema per request (a run's worth of them grew without limit); guarded as pool threads share it.
        self._checked: OrderedDict[Any, SessionError | None] = OrderedDict()
        self._checked_lock = threading.Lock()
        self.url = ""
        self._ids = 0

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> str:
        """Bind and serve in a background thread; returns the root URL (http://host:port)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._bind())
            except BaseException as exc:  # a taken port: reported by start()
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="roll-openai-server", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self.url

    async def _bind(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[web.middleware(_openai_errors)])
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/sessions/{sid}/reward", self._reward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # port 0: the one bound
        self.url = f"http://{self.host}:{port}"

    def close(self) -> None:
        """Stop serving (requests in flight are aborted and refused) and the worker threads."""
        # A request in flight held its worker thread (and the loop's shutdown, 10 s) until the engine answered; from
        # a stopped engine never, and the interpreter joins the pool's threads at exit: the process hung there.
        self.sessions.abort_all()
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def base_url(self, sid: str) -> str:
        """What an agent's `openai.OpenAI(base_url=...)` takes for session `sid`."""
        return f"{self.url}/sessions/{sid}/v1"

    def reward_url(self, sid: str) -> str:
        return f"{self.url}/sessions/{sid}/reward"

    # ---- handlers -----------------------------------------------------------------------------------------
    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        sid = request.match_info.get("sid")
        if sid is not None:  # an unknown session was a 200: the agent's check of its base_url passed, its chat 404ed
            try:
                if self.sessions.get(sid).closed:
                    raise SessionError(410, "session_closed", f"session {sid} has ended (episode timeout or shutdown)")
            except SessionError as exc:
                return _refused(exc)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "roll"}
        return web.json_response({"object": "list", "data": [model]})

    async def _reward(self, request: Any) -> Any:
        from aiohttp import web

        sid = request.match_info["sid"]
        try:
            body = await _json(request)
            session = self.sessions.get(sid)
            value = session.set_reward(body.get("reward") if isinstance(body, dict) else None)
        except SessionError as exc:
            return _refused(exc)
        return web.json_response({"session": sid, "reward": value})

    async def _chat(self, request: Any) -> Any:
        sid = request.match_info["sid"]
        loop = asyncio.get_running_loop()
        try:
            body = await _json(request)
            turn = chat_turn(body)
            if turn.structured is not None:
                await loop.run_in_executor(self._pool, self._check_structured, turn.structured)
            chat = functools.partial(self.sessions.chat, sid, turn, retry=is_retry(request.headers))
            reply = await loop.run_in_executor(self._pool, chat)
        except SessionError as exc:
            return _refused(exc)
        except Exception as exc:  # a bug, never the agent's fault: logged, the episode goes on or fails
            log.exception("session %s: chat request failed", sid)
            return _error(500, "internal_error", f"{type(exc).__name__}: {exc}", "server_error")
        self._ids += 1
        cid = f"chatcmpl-{sid}-{self._ids}"
        if body.get("stream"):
            return await self._stream(request, cid, reply, body)
        from aiohttp import web

        return web.json_response(
            {
                "id": cid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [
                    {"index": 0, "message": reply.message, "finish_reason": reply.finish_reason, "logprobs": None}
                ],
                "usage": _usage(reply),
            }
        )

    def _check_structured(self, structured: Any) -> None:
        """Refuse a constraint the engine cannot decode (asked once per distinct constraint)."""
        key = structured.key()
        with self._checked_lock:
            known = key in self._checked
            if known:
                self._checked.move_to_end(key)
                verdict = self._checked[key]
        if not known:
            from roll_core.interfaces import SamplingParams, UnsupportedSamplingError

            verdict = None
            try:
                check = getattr(self.sessions.infer, "check_sampling", None)
                if check is None:
                    raise UnsupportedSamplingError("the inference group cannot say whether it constrains decoding")
                check(SamplingParams(structured=structured))
            except (UnsupportedSamplingError, ValueError, TypeError) as exc:
                verdict = SessionError(400, "unsupported_response_format", f"response_format: {exc}")
            with self._checked_lock:
                self._checked[key] = verdict
                self._checked.move_to_end(key)
                while len(self._checked) > MAX_CHECKED_FORMATS:
                    self._checked.popitem(last=False)
        if verdict is not None:
            raise verdict

    async def _stream(self, request: Any, cid: str, reply: Reply, body: dict[str, Any]) -> Any:
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_name}
        msg = reply.message
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": msg.get("content") or ""}]
        if msg.get("tool_calls"):
            deltas.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]})
        chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**base, "choices": [], "usage": _usage(reply)})
        try:
            await resp.prepare(request)
            for chunk in chunks:
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
            # The client left (its timeout) while the turn ran: the turn stays recorded and its retry gets it; this
            # is no server error (it was logged as an unhandled one, with a traceback).
            log.debug("session %s: the client left before its streamed reply was sent", request.match_info["sid"])
        return resp


async def _json(request: Any) -> Any:
    from aiohttp import web

    try:
        return await request.json()
    except (ValueError, RecursionError) as exc:  # deep nesting was a 500 with a traceback, which clients retry
        raise SessionError(400, "invalid_json", f"the request body is not JSON: {exc}") from exc
    except LookupError as exc:  # an unknown Content-Type charset: a 500 "bug" with a traceback, which clients retry
        raise SessionError(400, "invalid_json", f"the request body's charset: {exc}") from exc
    except web.HTTPRequestEntityTooLarge as exc:  # no ValueError: it was a 500 with a traceback, which clients retry
        raise SessionError(413, "request_too_large", f"the request body is too large: {exc.text}") from exc


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }
