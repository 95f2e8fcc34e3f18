"""The code reward's verdict edges: its own counter of slow programs, exit status 152, the output budget's boundary
and a sandbox that cannot be started.

- The reward counted the model's slow programs in `timeouts`, the key roll's reward guard counts hung reward calls
  in: `reward/timeouts` mixed the two. Now they are `program_timeouts`.
- bwrap reports a death by SIGXCPU (the CPU-seconds limit) as exit status 152, so a program's own `sys.exit(152)`
  was counted a timeout. Now a 152 sooner than the CPU limit could have fired is a runtime error.
- A test expecting exactly `max_output_bytes` of output: the right program prints one newline more, was killed at the
  output budget and scored 0 as an output limit. Now such a test is not judged (`bad_answers`).
- An OSError starting the sandbox (EAGAIN from fork) was raised out of `score`: the guard rescored the batch row by
  row and counted `errors`. Now it is that row's `sandbox_errors`; the other rows keep their scores.

Tests that run programs need a working bubblewrap (`roll-envs[code]`); they skip with the reason otherwise.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from roll_core.cluster.reward_guard import GuardedReward
from roll_envs.rewards.code import COUNTERS, CodeReward, CodeTest, encode_tests
from roll_envs.sandbox import (
    RUNTIME_ERROR,
    SANDBOX_ERROR,
    TIMEOUT,
    PythonSandbox,
    SandboxLimits,
    SandboxUnavailableError,
    process,
    runner,
)

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = encode_tests([CodeTest("1 2\n", "3\n")])


def _reward_or_skip(**kwargs: Any) -> CodeReward:
    try:
        return CodeReward(**kwargs)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def fenced(code: str) -> str:
    return f"Here.\n```python\n{code}```\n"


def test_slow_programs_count_apart_from_the_guards_timeouts() -> None:
    reward = _reward_or_skip(timeout_s=1.0, parallelism=2)
    assert "program_timeouts" in COUNTERS and "timeouts" not in COUNTERS
    res = GuardedReward(reward, isolation="inline").score([fenced("while True: pass\n"), fenced(ADD)], [ADD_TESTS] * 2)
    assert res.correct == [0.0, 1.0] and res.failed == [False, False]
    # The program ran too long; the reward call itself did not: the guard's `timeouts` stays 0.
    assert res.counters["program_timeouts"] == 1 and res.counters["timeouts"] == 0, res.counters


# ---- exit status 152 (128 + SIGXCPU) ---------------------------------------------------------------------------


def test_a_program_exiting_152_under_bwrap_is_a_runtime_error() -> None:
    reward = _reward_or_skip(timeout_s=5.0, parallelism=1)
    res = reward.sandbox.run("import sys\nsys.exit(152)\n")
    assert (res.status, res.returncode) == (RUNTIME_ERROR, 152), res
    scored = reward.score([fenced("import sys\nsys.exit(128 + 24)\n")], [ADD_TESTS])
    assert scored.counters["runtime_errors"] == 1 and scored.counters["program_timeouts"] == 0


def test_unsandboxed_runs_tell_sigxcpu_from_exit_152(caplog: pytest.LogCaptureFixture) -> None:
    """Without bwrap the program is the direct child: its returncode says signal (-24) or exit status (152)."""
    with caplog.at_level(logging.WARNING):
        sandbox = PythonSandbox(SandboxLimits(timeout_s=5.0), unsandboxed=True)
    exited = sandbox.run("import sys\nsys.exit(152)\n")
    assert (exited.status, exited.returncode) == (RUNTIME_ERROR, 152), exited
    killed = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)\n")
    assert (killed.status, killed.returncode) == (TIMEOUT, -signal.SIGXCPU), killed


def _exits_152(status_fd: bool, cpu_limit_after_s: float | None) -> str:
    """Status of a child that signals ready and exits 152, its exit read as bwrap's (`status_fd`) or a direct one."""
    stdin_fd = os.open(os.devnull, os.O_RDONLY)
    ready_r, ready_w = os.pipe()
    status_r, status_w = os.pipe() if status_fd else (None, None)
    code = f"import os, sys\nos.write({ready_w}, b'1')\nsys.exit(152)\n"
    try:
        res = process.run_captured(
            [sys.executable, "-I", "-c", code],
            stdin_fd=stdin_fd,
            ready_fd=ready_r,
            pass_fds=(ready_w,) if status_w is None else (ready_w, status_w),
            timeout_s=30.0,
            max_output_bytes=1000,
            status_fd=status_r,
            cpu_limit_after_s=cpu_limit_after_s,
        )
    finally:
        for fd in (stdin_fd, ready_r, status_r):
            if fd is not None:
                os.close(fd)
    assert res.returncode == 152, res
    return res.status


def test_a_bwrap_152_is_sigxcpu_only_once_the_cpu_limit_could_have_fired() -> None:
    assert _exits_152(status_fd=True, cpu_limit_after_s=60.0) == RUNTIME_ERROR  # exited within its first minute
    assert _exits_152(status_fd=True, cpu_limit_after_s=0.0) == TIMEOUT  # may have been SIGXCPU: a timeout
    assert _exits_152(status_fd=True, cpu_limit_after_s=None) == TIMEOUT  # no bound given: as before
    assert _exits_152(status_fd=False, cpu_limit_after_s=None) == RUNTIME_ERROR  # a direct child's own status


def test_the_cpu_limit_bound_follows_the_limits() -> None:
    limits = SandboxLimits(timeout_s=5.0, max_processes=8)
    assert limits.rlimits()["RLIMIT_CPU"][0] == 6
    assert limits.cpu_limit_after_s == pytest.approx(6 / min(8, os.cpu_count() or 1))
    assert SandboxLimits(timeout_s=2.5, max_processes=1).cpu_limit_after_s == pytest.approx(3.0)


# ---- the output budget's boundary ------------------------------------------------------------------------------


def test_an_expected_output_of_exactly_the_budget_is_not_judged(caplog: pytest.LogCaptureFixture) -> None:
    """print() adds a newline: the right program's output is one byte over an expected output of max_output_bytes."""
    reward = _reward_or_skip(max_output_bytes=1000, parallelism=1, timeout_s=10.0)
    prints = fenced("print('x' * int(input()))\n")
    fits = encode_tests([CodeTest("999\n", "x" * 999 + "\n")])  # 999 + the newline: 1000 bytes
    at_budget = encode_tests([CodeTest("1000\n", "x" * 1000 + "\n")])  # 1001 bytes printed
    with caplog.at_level(logging.WARNING, logger="roll_envs.rewards.code"):
        res = reward.score([prints, prints], [fits, at_budget])
    assert res.correct == [1.0, 0.0] and res.failed == [False, True], res
    assert res.counters["bad_answers"] == 1 and res.counters["output_limits"] == 0, res.counters
    assert "expects 1001 bytes of output" in caplog.text, caplog.text


# ---- a sandbox that cannot be started --------------------------------------------------------------------------


def _fail_call(n: int, error: int) -> Any:
    """A stand-in for a callable that raises OSError(`error`) on its `n`-th call (1-based) and runs it otherwise."""
    calls = {"n": 0}

    def wrap(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == n:
                raise OSError(error, os.strerror(error))
            return real(*args, **kwargs)

        return call

    return wrap


def test_a_spawn_that_fails_is_that_rows_sandbox_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reward = _reward_or_skip(timeout_s=5.0, parallelism=1)  # one at a time: the second row's spawn fails
    monkeypatch.setattr(process.subprocess, "Popen", _fail_call(2, errno.EAGAIN)(subprocess.Popen))
    with caplog.at_level(logging.WARNING, logger="roll_envs.rewards.code"):
        res = GuardedReward(reward, isolation="inline").score([fenced(ADD)] * 3, [ADD_TESTS] * 3)
    assert res.correct == [1.0, 0.0, 1.0] and res.failed == [False, True, False], res
    assert res.counters["sandbox_errors"] == 1 and res.counters["errors"] == 0, res.counters
    assert res.counters["failed_unscored"] == 1
    assert caplog.text.count("the sandbox failed") == 1 and "could not start the sandbox" in caplog.text
    assert os.strerror(errno.EAGAIN) in caplog.text, caplog.text


def test_a_sandbox_run_whose_spawn_fails_returns_a_sandbox_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the spawn itself, for every caller of the sandbox (the code tool too): returned, never raised."""
    sandbox = _reward_or_skip(timeout_s=5.0, parallelism=1).sandbox
    monkeypatch.setattr(process.subprocess, "Popen", _fail_call(1, errno.EAGAIN)(subprocess.Popen))
    res = sandbox.run("print(1)\n")
    assert (res.status, res.returncode, res.stdout) == (SANDBOX_ERROR, None, ""), res
    assert "could not start the sandbox" in res.stderr and os.strerror(errno.EAGAIN) in res.stderr
    assert sandbox.run("print(1)\n").stdout == "1\n"  # the next spawn works: nothing was left behind


def test_an_oserror_setting_a_run_up_is_that_rows_sandbox_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the spawn (the run's in-memory files, EMFILE): the same per-row verdict, from the reward."""
    reward = _reward_or_skip(timeout_s=5.0, parallelism=2)
    real = runner._memfd

    def memfd(name: str, text: str) -> int:
        if name == "stdin" and text == "4 5\n":  # the second row's input
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(name, text)

    monkeypatch.setattr(runner, "_memfd", memfd)
    answers = [ADD_TESTS, encode_tests([CodeTest("4 5\n", "9\n")]), ADD_TESTS]
    res = reward.score([fenced(ADD)] * 3, answers)
    assert res.correct == [1.0, 0.0, 1.0] and res.failed == [False, True, False], res
    assert res.counters["sandbox_errors"] == 1
