"""The records of one chat turn of the agent endpoint (roll_core.agentic.agent_sessions re-exports them): the
request as the server validated it (`ChatTurn`), what a tool-call parser made of the reply's text (`ParsedReply`) and
the reply the turn produced (`Reply`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedReply:
    """What a tool-call parser made of a response's text: the message content and OpenAI `tool_calls`."""

    content: str | None
    #: [{"name": str, "arguments": str (JSON text)}] in order.
    calls: list[dict[str, str]] = field(default_factory=list)
    #: Tool-call blocks that did not parse (left in the content as text).
    invalid: int = 0


@dataclass
class ChatTurn:
    """One chat-completions request, validated by the server."""

    #: Normalised messages (see roll_core.agentic.agent_messages.normalise_message).
    messages: list[dict[str, Any]]
    #: The request's `tools` (OpenAI format), None when absent.
    tools: list[dict[str, Any]] | None = None
    #: The request's max_tokens / max_completion_tokens (None: the session's per-turn limit).
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    #: A constraint from `response_format` (roll_core.interfaces.StructuredOutput), None when absent.
    structured: Any = None
    #: False with tool_choice="none": tool-call syntax stays in the content.
    parse_tools: bool = True


@dataclass
class Reply:
    """The assistant message a turn produced and what the response JSON reports."""

    message: dict[str, Any]
    finish_reason: str  # OpenAI's: stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    logprobs: list[float]
