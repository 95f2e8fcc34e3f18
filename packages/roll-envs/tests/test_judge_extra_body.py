"""`env.reward.extra_body` fields that change what the judge's reply is are config errors
(roll_envs.rewards.judge): `n` > 1 asked the server for several samples of which only the first choice was read
(no aggregation, silently), `stream` gets no JSON body, and a field the judge's own settings send (`temperature`,
`max_tokens`, `model`, `chat_template_kwargs`) overrode that setting silently, `messages` was itself overridden."""

from __future__ import annotations

from typing import Any

import pytest

from roll_core.errors import ConfigError
from roll_envs.rewards.judge import JudgeReward, JudgeRewardConfig

pytest.importorskip("aiohttp")

URL = "http://127.0.0.1:9/v1"  # nothing is sent: the errors come before any request


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"n": 3}, r"extra_body\.n=3: the judge reads one reply per request"),
        ({"stream": True}, r"extra_body\.stream"),
        ({"temperature": 0.7}, r"extra_body\.temperature: set env\.reward\.temperature instead"),
        ({"max_tokens": 4096}, r"extra_body\.max_tokens: set env\.reward\.max_tokens instead"),
        # OpenAI's newer name: vLLM and OpenAI take it over max_tokens, so it overrode env.reward.max_tokens too
        ({"max_completion_tokens": 4096}, r"extra_body\.max_completion_tokens: set env\.reward\.max_tokens instead"),
        ({"model": "other"}, r"extra_body\.model: set env\.reward\.model instead"),
        ({"chat_template_kwargs": {}}, r"extra_body\.chat_template_kwargs: set env\.reward\.chat_template_kwargs"),
        ({"messages": []}, r"extra_body\.messages: the judge's template writes them"),
    ],
)
def test_extra_body_fields_that_change_the_reply_are_refused(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        JudgeReward(base_url=URL, extra_body=extra)
    with pytest.raises(ConfigError, match=match):
        JudgeRewardConfig(base_url=URL, extra_body=extra)


def test_other_extra_body_fields_are_sent() -> None:
    # vLLM's sampling and decoding extras change no judge setting: sent as given
    vllm = {"top_k": 20, "repetition_penalty": 1.1, "guided_json": {"type": "object"}, "skip_special_tokens": False}
    extra = {"seed": 0, "n": 1, "stream": False, "top_p": 0.9, **vllm}
    reward = JudgeReward(base_url=URL, temperature=0.5, extra_body=extra)
    assert reward.backend.body == {"model": "judge", "max_tokens": 512, "temperature": 0.5, **extra}
