"""The code reward's time budget, its logged sandbox errors and its ASCII-only number tokens.

- `score(..., time_budget_s=...)` (roll's reward guard gives it): the guard cuts a call off after its batch timeout,
  which lost every finished row of a slow batch; now the reward returns in time, finished rows kept, the rest
  `unfinished` and flagged `failed`.
- A sandbox error's cause (bwrap's stderr) is logged once; it was only counted.
- `float_tolerance` compares numbers written in ASCII digits only: `float()` takes a fullwidth `０.５` as 0.5.

Tests that run programs need a working bubblewrap (`roll-envs[code]`); they skip with the reason otherwise.
"""

from __future__ import annotations

import logging
import time

import pytest

from roll_core.interfaces.tasks import reward_kwargs
from roll_envs.rewards.code import CodeReward, CodeTest, encode_tests, outputs_match
from roll_envs.sandbox import SANDBOX_ERROR, RunResult, SandboxUnavailableError


@pytest.fixture(scope="module")
def reward() -> CodeReward:
    try:
        return CodeReward(timeout_s=1.0, parallelism=2)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def fenced(code: str) -> str:
    return f"Here.\n```python\n{code}\n```\n"


TESTS = encode_tests([CodeTest("1\n", "1\n"), CodeTest("2\n", "2\n")])
RIGHT, HANG = fenced("print(input())"), fenced("while True: pass")


def test_float_tolerance_reads_only_ascii_digits() -> None:
    assert outputs_match("0.30000000000000004", "0.3", 1e-9)  # still within tolerance
    assert not outputs_match("\uff10.\uff15", "0.5", 1e-6)  # fullwidth digits: float() reads 0.5
    assert not outputs_match("\u0660.\u0665", "0.5", 1e-6)  # Arabic-Indic digits
    assert not outputs_match("1 \uff12.0", "1 2.0", 1e-6)


def test_time_budget_keeps_finished_rows_and_flags_the_rest(reward: CodeReward) -> None:
    assert "time_budget_s" in reward_kwargs(reward, time_budget_s=1.0)  # the guard hands it over
    responses = [RIGHT] + [HANG] * 9  # unbudgeted: 9 timeouts of 1 s over 2 sandboxes, 5+ s
    start = time.monotonic()
    res = reward.score(responses, [TESTS] * len(responses), time_budget_s=4.0)
    took = time.monotonic() - start
    assert took < 4.0 + 1.0, took  # a test starts only when its clock (and a second for the start) fits
    assert res.scores[0] == 1.0 and res.correct[0] == 1.0 and res.failed is not None and not res.failed[0]
    unfinished = res.counters["unfinished"]
    assert unfinished >= 2 and sum(res.failed) == unfinished and res.counters["sandbox_errors"] == 0
    assert res.counters["program_timeouts"] + unfinished == 9  # every hanging row: judged a timeout or not judged
    assert all(s == 0.0 for s, f in zip(res.scores, res.failed) if f)


def test_no_budget_judges_every_row(reward: CodeReward) -> None:
    res = reward.score([RIGHT, HANG], [TESTS, TESTS])
    assert res.scores == [1.0, 0.0] and res.counters["unfinished"] == 0 and res.counters["program_timeouts"] == 1


def test_first_sandbox_error_is_logged_with_its_cause(
    reward: CodeReward, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = RunResult(SANDBOX_ERROR, "", "bwrap: Can't mkdir /nonexistent: Permission denied\n", 1, 0.1)
    monkeypatch.setattr(reward.sandbox, "run", lambda code, stdin="": broken)
    monkeypatch.setattr(reward, "_warned_sandbox", False, raising=False)
    with caplog.at_level(logging.WARNING, logger="roll_envs.rewards.code"):
        res = reward.score([RIGHT, RIGHT], [TESTS, TESTS])
    assert res.failed == [True, True] and res.counters["sandbox_errors"] == 2
    logged = [r.getMessage() for r in caplog.records if "sandbox failed" in r.getMessage()]
    assert len(logged) == 1 and "Can't mkdir /nonexistent" in logged[0], logged
