"""The `code` tool: a model's program runs in the OS sandbox, never in this process, and the model reads back its
output or an error it can act on. Tests that run programs skip where bubblewrap cannot run (install
roll-envs[code])."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing.envs import EnvTestSuite
from roll_envs.agentic.code_tool import CodeTool, strip_fence
from roll_envs.agentic.tool_env import ToolMathEnv, ToolUseEnv
from roll_envs.agentic.tools import get_tool
from roll_envs.sandbox import SandboxUnavailableError
from roll_envs.sandbox import bwrap as bwrap_module


@pytest.fixture(scope="module")
def tool() -> CodeTool:
    try:
        return CodeTool(timeout_s=2.0, max_output_chars=300)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def test_fences_are_stripped() -> None:
    assert strip_fence("```python\nprint(1)\nprint(2)\n```") == "print(1)\nprint(2)"
    assert strip_fence("```\nx = 1\n```  ") == "x = 1"
    assert strip_fence("  print(3)  ") == "print(3)"
    assert strip_fence("print('```')") == "print('```')"


def test_programs_run_and_errors_are_readable(tool: CodeTool) -> None:
    before = dict(tool.counts)
    assert tool("```python\nprint(sum(i * i for i in range(10)))\n```").strip() == "285"
    assert tool("x = 3") == "(the program printed nothing; use print() to see values)"
    crash = tool("print('partial')\n1 / 0")
    assert crash.startswith("partial\n") and "error: the program failed" in crash and "ZeroDivisionError" in crash
    assert "longer than 2 s" in tool("while True: pass")
    flood = tool("print('y' * 10_000_000)")
    assert flood.startswith("y" * 300 + "... [")
    assert flood.endswith("\nerror: the program printed too much and was stopped")
    long = tool("print('z' * 1000)")
    assert long.startswith("z" * 300) and long.endswith("... [701 more characters]")
    assert tool("").startswith("error: empty program")
    assert tool("x" * 20_001).startswith("error: the program is 20001 characters")
    counts = {k: tool.counts[k] - before.get(k, 0) for k in tool.counts}
    assert counts == {"ok": 3, "runtime_error": 1, "timeout": 1, "output_limit": 1, "refused": 1}


def test_a_failed_program_s_exit_status_or_signal_is_shown(tool: CodeTool) -> None:
    """`sys.exit(3)`, or a kill (the memory limit's SIGKILL), printed nothing on stderr: the model read a bare
    "error: the program failed" with no hint of why."""
    assert tool("import sys\nprint('hi')\nsys.exit(3)") == "hi\n\nerror: the program failed (exit status 3)"
    killed = tool("import os\nos.kill(os.getpid(), 9)")
    assert killed.startswith("error: the program failed (killed by SIGKILL; the memory limit ends a program")
    crash = tool("1 / 0")
    assert crash.startswith("error: the program failed (exit status 1):\n") and "ZeroDivisionError" in crash


def test_programs_run_outside_this_process(tool: CodeTool, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-42")
    leak = tool(f"print(open({str(secret)!r}).read())")
    assert "TOP-SECRET-42" not in leak and "error: the program failed" in leak
    marker = tmp_path / "written.txt"
    tool(f"open({str(marker)!r}, 'w').write('x')")
    assert not marker.exists()
    # Its own PID namespace: the program cannot see this process.
    pids = tool("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert str(os.getpid()) not in pids.strip("[]\n").split(", ")
    # Nothing persists between calls.
    tool("open('/tmp/state', 'w').write('kept')")
    assert "FileNotFoundError" in tool("print(open('/tmp/state').read())")


def test_tool_env_takes_the_code_tool_with_options(tool: CodeTool) -> None:
    env = ToolMathEnv(tools=[{"name": "code", "timeout_s": 2.0, "max_output_chars": 300}], seed=3)
    obs, _ = env.reset(seed=3)
    assert "code: runs a Python 3 program" in env.instructions() and "<tool>code: print(" in env.instructions()
    # The expert computes with the code tool, then answers with what it printed.
    obs, reward, done, _, info = env.step(env.expert_reply())
    assert info["tool_calls"] == 1 and not done and f"\n{env.env.answer}\n" in obs
    obs, reward, done, _, info = env.step(env.expert_reply())
    assert done and reward == 1.0 and info["success"]


def test_tool_specs_are_checked() -> None:
    with pytest.raises(ValueError, match="needs a 'name' key"):
        ToolUseEnv(ToolMathEnv(), tools=[{"timeout_s": 2}])
    with pytest.raises(ValueError, match="unknown tool 'shell'; available: calculator, code, python, retrieval"):
        get_tool("shell")
    with pytest.raises(TypeError):
        get_tool("code", no_such_option=1)


def test_without_a_sandbox_the_tool_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(path: str | None = None) -> str:
        raise FileNotFoundError("bwrap not found (test)")

    monkeypatch.setattr(bwrap_module, "find_bwrap", missing)
    # Limits no other test uses: the process-wide sandbox cache must not answer for this one.
    with pytest.raises(SandboxUnavailableError, match=r"needs bubblewrap.*allow_unsandboxed_execution"):
        CodeTool(timeout_s=3.25)


def test_the_risk_flag_still_uses_a_working_sandbox(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`allow_unsandboxed_execution_i_understand_the_risk` is a fallback for hosts without a sandbox: where
    bubblewrap works the program still runs in it (the flag alone ran every program unsandboxed, able to read the
    trainer's files)."""
    try:
        CodeTool(timeout_s=2.0)  # skip where no sandbox works here
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")
    # Limits no other test uses: the process-wide sandbox cache must not answer for this one.
    tool = CodeTool(timeout_s=3.75, allow_unsandboxed_execution_i_understand_the_risk=True)
    assert tool.sandbox.mode == "bwrap"
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    assert "FileNotFoundError" in tool(f"print(open({str(secret)!r}).read())")

    def missing(path: str | None = None) -> str:
        raise FileNotFoundError("bwrap not found (test)")

    monkeypatch.setattr(bwrap_module, "find_bwrap", missing)
    with caplog.at_level(logging.WARNING):
        fallback = CodeTool(timeout_s=3.5, allow_unsandboxed_execution_i_understand_the_risk=True)
    assert fallback.sandbox.mode == "unsandboxed" and fallback("print(6 * 7)").strip() == "42"
    assert "code tool: no working sandbox (" in caplog.text and "running programs unsandboxed" in caplog.text


def test_programs_of_many_episodes_run_at_most_parallelism_at_once(running_programs: Callable[[], int]) -> None:
    """Episodes step in a thread each (hundreds at once): the tools' programs queue for `parallelism` slots
    instead of starting a sandbox, with its memory and process budget, per episode."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    try:
        tools = [CodeTool(timeout_s=30.0, parallelism=2) for _ in range(6)]  # one tool per environment
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], running_programs())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            outputs = list(pool.map(lambda t: t("import time\ntime.sleep(1)\nprint('done')"), tools))
    finally:
        stop.set()
        sampler.join()
    assert outputs == ["done\n"] * 6
    assert 1 <= peak[0] <= 2, f"{peak[0]} programs at once with parallelism=2"
    with pytest.raises(ValueError, match="parallelism"):
        CodeTool(parallelism=0)


class TestToolMathWithCode(EnvTestSuite):
    """The Env conformance suite over the tool-math environment whose only tool is the sandboxed `code` tool."""

    @classmethod
    def build_env(cls) -> ToolMathEnv:
        try:
            return ToolMathEnv(tools=[{"name": "code", "timeout_s": 2.0}], max_tool_calls=2)
        except SandboxUnavailableError as exc:
            pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")

    @classmethod
    def solving_actions(cls, env: Any, seed: int) -> list[str]:
        return [f"<tool>code: print({env.env.expression})</tool>", f"So the answer is \\boxed{{{env.env.answer}}}."]

    @classmethod
    def illegal_actions(cls, env: Any, seed: int) -> list[str]:
        return ["<tool>calculator: 1+1</tool>", "<tool>code print(1)</tool>"]

    @classmethod
    def stalling_action(cls, env: Any) -> str:
        return "<tool>code: print(1)</tool>"


def test_a_hydra_config_builds_the_code_tool(tool: CodeTool) -> None:
    from hydra.utils import instantiate

    from roll_core.config.compose import compose

    cfg = compose(["pipeline=agentic", "env=tool_math", "env.env_kwargs.tools=[calculator,{name:code,timeout_s:2}]"])
    env = instantiate(cfg.env).make_env()
    assert sorted(env.tools) == ["calculator", "code"] and env.tools["code"].sandbox.limits.timeout_s == 2.0
    env.reset(seed=0)
    assert env.step("<tool>code: print(6 * 7)</tool>")[0].startswith("<tool_output>\n42\n")


def test_an_error_survives_the_environment_s_output_cut(tool: CodeTool) -> None:
    """With default sizes, a program that floods its output still shows the model why it stopped: the tool's own
    cut leaves room for its error line inside the environment's observation limit."""
    env = ToolMathEnv(tools=[{"name": "code", "timeout_s": 2.0}], seed=1)
    env.reset(seed=1)
    obs = env.step("<tool>code: print('y' * 10_000_000)</tool>")[0]
    assert "error: the program printed too much" in obs and "... [truncated]" not in obs


def test_a_program_that_printed_and_then_failed_is_a_counted_error_output(tool: CodeTool) -> None:
    """The error line comes after what the program printed: info["tool_error_outputs"] counted a crash after a
    print as a success (its text does not start with `error:`) and a successful program printing `error: ...` as a
    failure."""
    env = ToolMathEnv(tools=[tool], max_tool_calls=3, seed=0)
    env.reset(seed=0)
    replies = ["<tool>code: print('partial')\n1 / 0</tool>", "<tool>code: print('error: not really')</tool>"]
    steps = [env.step(reply) for reply in replies]
    assert "partial\n\nerror: the program failed" in steps[0][0] and "error: not really" in steps[1][0]
    assert [info["tool_error_outputs"] for *_, info in steps] == [1, 0]
    assert [info["tool_errors"] for *_, info in steps] == [0, 0]
