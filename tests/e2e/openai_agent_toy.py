"""A small agent program written against the `openai` package, trained by `pipeline=agent env=openai_agent
env.program=openai_agent_toy:run env.generator=openai_agent_toy:tasks` (tests/e2e/test_openai_agent.py).

A multi-turn tool-calling loop: each turn offers a calculator tool; a tool call is executed and its result sent
back as a `tool` message (the turn does not count), a text reply is judged: 0.5 when it ends with the task's digit.
Two judged turns at most, then the program returns its reward (or, for odd task ids, POSTs it and returns None).
A random tiny model learns to end its replies with the digit within a few GRPO steps (like agentic_toy.SayDigit).
"""

from __future__ import annotations

import json
from typing import Any

from roll_envs.agentic.openai_agent import report_reward

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def tasks(n: int = 64, digit: str = "7") -> list[dict[str, Any]]:
    """The task rows: an id and the digit to say."""
    return [{"id": i, "digit": digit} for i in range(n)]


def _tool(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments)
        return str(int(args["a"]) + int(args["b"])) if call.function.name == "add" else "unknown tool"
    except (ValueError, KeyError, TypeError):
        return "bad arguments"


def run(client: Any, task: dict[str, Any], max_requests: int = 4) -> float | None:
    """One episode; the reward, or None after POSTing it (odd ids)."""
    digit = task["digit"]
    messages: list[Any] = [{"role": "user", "content": f"Task {task['id']}: say {digit}"}]
    reward, judged = 0.0, 0
    for _ in range(max_requests):
        reply = client.chat.completions.create(model="toy", messages=messages, tools=TOOLS, max_tokens=6)
        message = reply.choices[0].message
        messages.append(message)  # the client's own message object, echoed back as agents do
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": _tool(call)})
            continue
        judged += 1
        reward += 0.5 * (message.content or "").strip().endswith(digit)
        if judged == 2:
            break
        messages.append({"role": "user", "content": f"Again: say {digit}"})
    if task["id"] % 2:
        report_reward(client, reward)
        return None
    return reward


def flaky(client: Any, task: dict[str, Any]) -> float | None:
    """Fails by task id: 0 raises, 1 waits on a turn that never finishes (the episode times out), 2 reports no
    reward, 3 rewrites its history before returning 1.0."""
    kind = task["id"] % 4
    if kind == 0:
        raise RuntimeError("agent bug")
    messages: list[Any] = [{"role": "user", "content": "hang" if kind == 1 else f"Task {task['id']}"}]
    reply = client.chat.completions.create(model="toy", messages=messages)
    if kind == 2:
        return None
    messages = [{"role": "user", "content": "a summary of the conversation so far"}]  # history rewritten
    client.chat.completions.create(model="toy", messages=messages)
    return 1.0 if reply.choices[0].message.content else 0.0


COMMAND = """
import json, os, sys
import openai
task = json.load(sys.stdin)
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
reply = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": f"Task {task['id']}"}])
print("log line")
print(0.25 if reply.choices[0].message.content else 0.0)
"""
