"""env=openai_agent under a cluster's HTTP proxy: the endpoint is on this host's loopback, so the program's client,
`report_reward` and a command's own openai client reach it directly. With HTTP_PROXY set and no NO_PROXY, every
request went to the proxy (which cannot reach the loopback) and every episode failed with a connection error."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from roll_core.agentic.agent_sessions import SessionLimits
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.agent_endpoint import ScriptedTextEngine, serve
from roll_envs.agentic import openai_agent
from roll_envs.agentic.openai_agent import OpenAIAgentTask

pytest.importorskip("openai")

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
LIMITS = SessionLimits(max_turns=4, max_tokens_per_turn=16, max_context_length=1024)
#: A proxy nothing listens on (port 9, discard): a request sent to it fails at once.
DEAD_PROXY = "http://127.0.0.1:9"

# A command line agent: the openai client from OPENAI_BASE_URL / OPENAI_API_KEY (as an unmodified program makes it,
# honouring the environment's proxies), one turn, its reward POSTed with urllib (which honours them too).
COMMAND = """
import json, os, urllib.request, openai
reply = openai.OpenAI(max_retries=0).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
req = urllib.request.Request(os.environ["ROLL_REWARD_URL"], data=json.dumps({"reward": 0.75}).encode(),
                             headers={"Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=30).read()
print(reply.choices[0].message.content)
"""


def _program(client: Any, row: dict[str, Any]) -> None:
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    openai_agent.report_reward(client, 0.5)


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(key, DEAD_PROXY)
    for key in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(key, raising=False)
    module = types.ModuleType("proxied_agent_program")
    module.run = _program  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)


@pytest.fixture
def endpoint(proxied: None, tmp_path: Path) -> Any:
    """(sessions, server, the rows file) of a local endpoint that answers "hello" to every turn."""
    tokenizer = build_tiny_tokenizer()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": 0}) + "\n")
    sessions, server = serve(ScriptedTextEngine(tokenizer, ["hello"] * 4), tokenizer)
    sessions.open("ep", PARAMS, LIMITS)
    yield sessions, server, str(rows)
    server.close()


def test_a_program_and_report_reward_reach_the_endpoint_past_the_environments_proxy(endpoint: Any) -> None:
    sessions, server, rows = endpoint
    task = OpenAIAgentTask(program="proxied_agent_program:run", path=rows, eval_fraction=0)
    try:
        assert task.run_episode(server.base_url("ep"), server.reward_url("ep"), {"id": 0}) is None
    finally:
        task.close()
    assert sessions.get("ep").reward == 0.5 and sessions.get("ep").traj.turns == 1


def test_a_command_reaches_the_endpoint_past_the_environments_proxy(endpoint: Any) -> None:
    sessions, server, rows = endpoint
    task = OpenAIAgentTask(command=[sys.executable, "-c", COMMAND], path=rows, eval_fraction=0)
    task.run_episode(server.base_url("ep"), server.reward_url("ep"), {"id": 0})
    assert sessions.get("ep").reward == 0.75 and sessions.get("ep").traj.turns == 1


def test_no_proxy_keeps_the_hosts_given_and_adds_the_loopback_once() -> None:
    no_proxy_env = openai_agent.no_proxy_env
    assert no_proxy_env({}) == {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    env = {"NO_PROXY": "corp.example, localhost", "no_proxy": "127.0.0.1"}
    assert no_proxy_env(env) == {"NO_PROXY": "corp.example,localhost,127.0.0.1", "no_proxy": "127.0.0.1,localhost"}
