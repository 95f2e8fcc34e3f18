"""The OpenAI-compatible agent endpoint (roll_core.agentic.openai_server) for tests, over HTTP on 127.0.0.1.

- `serve(infer, tokenizer)`: `AgentSessions` over a request engine (anything with `submit_request`, `abort` and
  `check_sampling`, as `InferGroup`) with the tokenizer's chat template and Hermes tool calls, and a started
  `OpenAIServer` in front of them; the caller opens sessions and closes the server.
- `ScriptedTextEngine`: a request engine that answers each request with the tokens of the next scripted text.
- `gives_up_on_refusal(seen)`: an agent program (`run_episode(base_url, reward_url, row)`) that gives up when the
  endpoint refuses its second turn.
- `post_json` and `openai_client`: a raw HTTP request and the real `openai` client, for one session.

The `openai` package (roll-core's test extra) is imported only by the helpers that use it; pytest not at all.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from roll_core.agentic.agent_sessions import AgentSessions
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import HermesToolParser, OpenAIServer
from roll_core.interfaces import Request, RequestOutput, SamplingParams, UnsupportedSamplingError

__all__ = ["ScriptedTextEngine", "gives_up_on_refusal", "openai_client", "post_json", "quick_idle_backoff", "serve"]


def serve(infer: Any, tokenizer: Any, **kwargs: Any) -> tuple[AgentSessions, OpenAIServer]:
    """Sessions over the request engine `infer` (replies decoded without special tokens, Hermes tool calls) and a
    started server for them; `kwargs` go to `AgentSessions` (`on_rewrite`). Close the server when done."""
    sessions = AgentSessions(
        infer,
        TurnTemplate(tokenizer),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        HermesToolParser(),
        **kwargs,
    )
    server = OpenAIServer(sessions)
    server.start()
    return sessions, server


class ScriptedTextEngine:
    """Answers each request with the tokens of the next text of `texts` and EOS (log-prob -0.25 each, finish reason
    `stop`); refuses constrained sampling (`UnsupportedSamplingError`), as an engine without structured outputs."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        """A future already holding the next text's output."""
        ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.25] * len(ids), "stop"))
        return fut

    def abort(self, request_id: str) -> bool:
        """Nothing runs to abort: every request is answered at once."""
        return False

    def check_sampling(self, params: SamplingParams) -> None:
        """Refuse structured outputs (response_format), accept the rest."""
        if params.structured is not None:
            raise UnsupportedSamplingError("scripted: no structured outputs")


def quick_idle_backoff(monkeypatch: Any) -> None:
    """Waits of a millisecond between a refused turn's tries (roll_core.idle_aborts), for tests that are not about the
    waits; `monkeypatch`: pytest's, which puts them back after the test."""
    from roll_core import idle_aborts

    monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_S", 0.001)
    monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_MAX_S", 0.001)


def gives_up_on_refusal(seen: list[Any]) -> Callable[[str, str, Any], float]:
    """An agent program (a task's `run_episode`): says "hi", then asks a second turn with the first reply in its
    history; when the endpoint refuses it (`openai.APIStatusError`), appends the error to `seen` and raises it (the
    agent gives up); returns the reward 1.0 when both turns were served."""
    import openai

    hi = [{"role": "user", "content": "hi"}]

    def gives_up(base_url: str, reward_url: str, row: Any) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="m", messages=hi)
        try:
            client.chat.completions.create(model="m", messages=[*hi, first.choices[0].message, *hi])
        except openai.APIStatusError as exc:
            seen.append(exc)
            raise
        return 1.0

    return gives_up


def post_json(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """POST `body` (JSON bytes, sent as is) to `url` with `headers` besides the JSON Content-Type: (HTTP status, the
    JSON answer), errors included."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def openai_client(server: OpenAIServer, sid: str) -> Any:
    """The `openai` client of session `sid` on `server`, with no retries of its own (an `openai.OpenAI`)."""
    import openai

    return openai.OpenAI(base_url=server.base_url(sid), api_key="unused", max_retries=0)
