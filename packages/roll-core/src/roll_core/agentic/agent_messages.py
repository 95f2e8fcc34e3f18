"""OpenAI chat messages as the agent endpoint's sessions take them (roll_core.agentic.agent_sessions).

Contract: `normalise_message` turns a request's message into {"role", "content": str | None, ["tool_calls"],
["tool_call_id"], ["name"]} or raises `SessionError` (HTTP 400) naming the message (as OpenAI, content may be left
out only by an assistant message with tool calls, and a tool message needs its `tool_call_id`); a field sent as JSON
null is one not sent, as OpenAI reads it; `check_tool_results` refuses (400) a tool message that answers no call of
the assistant message it follows; `turn_key` is what makes two requests the same request (a client's retry);
`template_message` is a normalised message as chat templates take it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roll_core.agentic._agent_turns import ChatTurn

ROLES = ("system", "developer", "user", "assistant", "tool")


class SessionError(Exception):
    """A request the session refuses: HTTP `status` with an OpenAI error `code` (the server's error JSON);
    `retry_after`: seconds for the response's Retry-After header (a transient refusal, 503), None for none."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        kind: str = "invalid_request_error",
        *,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.kind = status, code, message, kind
        self.retry_after = retry_after


def normalise_message(raw: Any, index: int) -> dict[str, Any]:
    """An OpenAI chat message as {"role", "content": str | None, ["tool_calls"], ["tool_call_id"], ["name"]};
    content parts of type text are joined by newlines, as vLLM's OpenAI server joins them for a chat template that
    takes string content (the prompt tokenizes as under vLLM serving). Raises SessionError (400) naming the message
    for anything else."""
    if not isinstance(raw, dict):
        raise SessionError(400, "invalid_message", f"messages[{index}] must be an object, got {type(raw).__name__}")
    role = raw.get("role")
    if role not in ROLES:
        raise SessionError(400, "invalid_message", f"messages[{index}].role={role!r} is not one of {ROLES}")
    content = raw.get("content")
    # OpenAI answers 400 to both: a user turn without text reached the template as "", and a tool result without
    # the id of its call could not be matched to one (the agent's bug, hidden behind a 200 reply).
    if content is None and role != "assistant":
        raise SessionError(400, "invalid_message", f"messages[{index}].content is required for a {role} message")
    if role == "tool" and not isinstance(raw.get("tool_call_id"), str):
        raise SessionError(
            400, "invalid_message", f"messages[{index}].tool_call_id is required (a string) for a tool message"
        )
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise SessionError(
                    400, "invalid_message", f"messages[{index}].content[{k}]: only text parts are supported"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise SessionError(400, "invalid_message", f"messages[{index}].content must be a string, a list or null")
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    calls = raw.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise SessionError(400, "invalid_message", f"messages[{index}].tool_calls belongs to assistant messages")
        msg["tool_calls"] = [_normalise_call(c, index, k) for k, c in enumerate(calls)]
    elif content is None and role == "assistant":
        # OpenAI answers 400: an empty turn reached the template as "" (a prompt the model never sampled), and a
        # session's reply always has one or the other (`AgentSessions._chat`), so this is the agent's bug.
        raise SessionError(
            400, "invalid_message", f"messages[{index}]: an assistant message needs content or tool_calls (got neither)"
        )
    for key in ("tool_call_id", "name"):
        if raw.get(key) is not None:
            msg[key] = str(raw[key])
    return msg


def check_tool_results(messages: list[dict[str, Any]]) -> None:
    """Raise SessionError (400, as OpenAI answers) for a tool message (normalised) that answers no tool call: its
    `tool_call_id` must be the id of a call of the assistant message it follows (with only tool messages between).
    Chat templates render results in message order without their ids, so a result sent for another call, or after
    a user turn, reached the model as the answer to a call it did not make, behind a 200 reply."""
    ids: list[str] = []  # the calls of the assistant message the tool messages so far follow
    for index, msg in enumerate(messages):
        if msg["role"] == "assistant":
            ids = [c["id"] for c in msg.get("tool_calls", [])]
        elif msg["role"] != "tool":
            ids = []
        elif msg["tool_call_id"] not in ids:
            where = f"the calls {ids}" if ids else "no tool calls"
            raise SessionError(
                400,
                "invalid_message",
                f"messages[{index}].tool_call_id={msg['tool_call_id']!r} answers no tool call: a tool message must "
                f"follow the assistant message whose call it answers (the assistant message before it has {where})",
            )


def _normalise_call(call: Any, index: int, k: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise SessionError(400, "invalid_message", f"messages[{index}].tool_calls[{k}] needs function.name")
    # null is "not given", as a left-out field (it was the text "null" / "None", a call the model never wrote).
    args = fn.get("arguments")
    if args is None:
        args = ""
    elif not isinstance(args, str):
        args = json.dumps(args)
    cid = "" if call.get("id") is None else str(call["id"])
    return {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def message_key(msg: dict[str, Any]) -> tuple[Any, ...]:
    """What must be equal for a repeated message to be the same message (text as sent, arguments as JSON values)."""
    calls = tuple(
        (c["id"], c["function"]["name"], _json_value(c["function"]["arguments"])) for c in msg.get("tool_calls", [])
    )
    return (msg["role"], msg.get("content") or "", calls, msg.get("tool_call_id"), msg.get("name"))


def turn_key(turn: ChatTurn) -> str:
    """What makes two requests the same request (a client's retry): messages, tools and generation settings."""
    return json.dumps(
        [
            [message_key(m) for m in turn.messages],
            turn.tools,
            turn.max_tokens,
            list(turn.stop),
            repr(turn.structured),
            turn.parse_tools,
        ],
        sort_keys=True,
        default=str,
    )


def _json_value(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except (TypeError, ValueError, RecursionError):  # deep nesting: compared as text (it was a 500)
        return text


def template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template raises for messages it refuses (jinja comes with the tokenizer's chat templates)."""
    try:
        from jinja2 import TemplateError
    except ImportError:
        return ()
    return (TemplateError,)


def template_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A normalised message as chat templates take it (tool-call arguments as objects, content a string)."""
    out = {k: v for k, v in msg.items() if k != "tool_calls"}
    out["content"] = msg.get("content") or ""
    if msg.get("tool_calls"):
        calls = []
        for c in msg["tool_calls"]:
            try:
                args = json.loads(c["function"]["arguments"])
            except (TypeError, ValueError, RecursionError):
                args = c["function"]["arguments"]
            calls.append({"id": c["id"], "type": "function", "function": {**c["function"], "arguments": args}})
        out["tool_calls"] = calls
    return out
