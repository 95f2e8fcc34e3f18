"""Answers a grader misread: numbers in scientific notation (math reward, roll_envs.numeric) and a verifier
service's `failed` flag of the wrong type (remote reward)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("math_verify")
pytest.importorskip("aiohttp")

from aiohttp import web

from roll_envs.numeric import numbers_equal, parse_number
from roll_envs.rewards.math import MathReward, canonical_answer
from roll_envs.rewards.remote import RemoteReward
from roll_envs.rewards.serve import RunningServer


def test_scientific_notation_is_a_number_not_eulers_e() -> None:
    reward = MathReward()
    responses = [
        "\\boxed{0.00001}",  # right against the str() of a float, 1e-05
        "\\boxed{1e-5}",  # right
        "\\boxed{1.5e3}",  # right
        "\\boxed{6.02 \\times 10^{23}}",  # right (math-verify rounded the float and said wrong)
        "\\boxed{e-5}",  # Euler's number minus 5: wrong (math-verify read 1e-05 as e - 5 and said right)
        "\\boxed{2.5e3}",  # wrong
    ]
    answers = ["1e-05", "0.00001", "1500", "602000000000000000000000", "1e-05", "1500"]
    res = reward.score(responses, answers)
    assert res.correct == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert res.counters == {"timeouts": 0, "errors": 0, "no_boxed": 0, "bad_answers": 0}
    # One vote key per value; an exponent too large to compute exactly is no quantity (math-verify's case).
    assert canonical_answer("1.5e3") == canonical_answer("1500") == "1500"
    assert canonical_answer("1e-5") == "0.00001" and canonical_answer("1e99999") == "1e99999"
    # The shared numeric rule (the QA environment's too).
    assert numbers_equal("1e-05", "0.00001") and parse_number("1.5E3") == 1500
    with pytest.raises(ValueError):
        parse_number("1e99999")


def test_a_failed_flag_that_is_not_a_boolean_is_malformed() -> None:
    async def handle(request: web.Request) -> web.Response:
        rows = [{"score": 0.0, "failed": "true"}, {"score": 0.0, "failed": 1}, {"score": 1.0, "failed": False}]
        return web.json_response({"rows": rows})

    app = web.Application()
    app.add_routes([web.post("/score", handle)])
    running = RunningServer(app, "127.0.0.1", 0)
    try:
        reward: Any = RemoteReward(f"http://127.0.0.1:{running.port}/score", error_score=-1.0, max_retries=0)
        res = reward.score(["a", "b", "c"], ["x", "y", "z"])
    finally:
        running.stop()
    # Rows 0 and 1 were trained on as verdicts of 0; they are unscored, counted malformed.
    assert res.scores == [-1.0, -1.0, 1.0] and res.failed == [True, True, False]
    assert res.counters["remote_malformed"] == 2 and res.counters["unscored"] == 2
    assert "failed='true'" in reward.last_failure
