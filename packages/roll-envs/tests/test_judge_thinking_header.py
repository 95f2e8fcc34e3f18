"""A local (engine) judge whose chat template opens `<think>` in its generation header (DeepSeek-R1 distills, QwQ,
Qwen3 Thinking-2507): its reply is the reasoning, `</think>`, then the verdict, with no opening tag. Cut off by
max_tokens while reasoning, it had neither tag and was read whole: a score of its unfinished reasoning became the
row's reward (roll_envs.rewards.judge_backends.EngineBackend puts the tag back: roll_core.thinking.reply_text)."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing.chat_templates import DEEPSEEK_R1, family_tokenizer
from roll_core.testing.recording_engine import RecordingEngine
from roll_envs.rewards.judge import JudgeReward


class _Replies(RecordingEngine):
    """A RecordingEngine answering the i-th request with `replies[i]` = (text ids, finish reason)."""

    def __init__(self, replies: list[tuple[list[int], str]]) -> None:
        super().__init__([])
        self.replies = replies

    def submit(self, request: Any) -> Future:
        from roll_core.interfaces import RequestOutput

        ids, finish = self.replies[len(self.prompts)]
        self.prompts.append(list(request.prompt_ids))
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [0.0] * len(ids), finish))
        return fut


def _judge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, opens: bool, replies: list[tuple[str, str]]) -> Any:
    from transformers import AutoTokenizer

    tok = family_tokenizer("deepseek_r1")
    if opens:  # R1's current template: the generation prompt ends inside a think block
        header = "'<|Assistant|>' -}}{%- endif -%}"
        assert DEEPSEEK_R1.endswith(header)
        tok.chat_template = DEEPSEEK_R1[: -len(header)] + "'<|Assistant|><think>\\n' -}}{%- endif -%}"
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path, **kw: tok if path == str(tmp_path) else None)
    engine = {"name": "hf", "device": "cpu", "dtype": "float32"}
    reward = JudgeReward(backend="engine", model=str(tmp_path), engine=engine, template="correctness")
    encoded = [(tok(text, add_special_tokens=False)["input_ids"], finish) for text, finish in replies]
    monkeypatch.setattr(reward.backend, "_cls", lambda: lambda **_: _Replies(encoded))
    return reward


def test_a_thinking_judge_cut_off_while_reasoning_is_truncated_not_its_reasonings_score(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    replies = [
        ("The response says 41, the reference 42. Maybe Score: 3? Hmm, unless", "length"),  # cut off thinking
        ("Off by one. Score: 2 at most?\n</think>\n\nWrong number.\nScore: 1", "stop"),  # finished
        ("It spells 42 as forty-two. Score: 9", "stop"),  # ended without closing its reasoning
    ]
    reward = _judge(monkeypatch, tmp_path, True, replies)
    res = reward.score(["41", "43", "forty-two"], ["42"] * 3, prompts=["6*7?"] * 3)
    # The cut-off reasoning's "Score: 3" was read as 0.3, a verdict (not failed); the unclosed one's 9 as 0.9.
    assert res.scores == pytest.approx([0.0, 0.1, 0.0])
    assert res.failed == [True, False, False] and res.formatted == [0.0, 1.0, 0.0]
    assert (res.counters["judge_truncated"], res.counters["judge_invalid"]) == (1, 1)


def test_a_judge_whose_header_opens_nothing_is_read_as_before(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    replies = [("Off by one. Score: 3", "stop"), ("<think>Close.</think>Score: 8", "length")]
    reward = _judge(monkeypatch, tmp_path, False, replies)
    res = reward.score(["41", "43"], ["42"] * 2, prompts=["6*7?"] * 2)
    assert res.scores == pytest.approx([0.3, 0.8]) and res.failed == [False, False]


@pytest.mark.parametrize("family", ["chatml", "qwen3"])
def test_a_think_tag_the_judge_template_spells_after_the_response_opens_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, family: str
) -> None:
    """Only the chat template's generation header decides (roll_core.thinking.header_opens_think): a judge
    template whose own text after `{response}` names the tag ("Do not write <think> tags") opened nothing, yet it
    was read as opening the block, so every plain verdict became unfinished reasoning (invalid, the row failed).
    Qwen3 with enable_thinking=false closes its header's empty block: no opening either."""
    from transformers import AutoTokenizer

    tok = family_tokenizer(family)
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path, **kw: tok if path == str(tmp_path) else None)
    template = "Reference: {answer}\nResponse: {response}\nDo not write <think> tags. Reply: Score: N (0-10)."
    kwargs = {"enable_thinking": False} if family == "qwen3" else {}
    reward = JudgeReward(
        backend="engine", model=str(tmp_path), template=template, chat_template_kwargs=kwargs, engine={"name": "hf"}
    )
    replies = [("Score: 8", "stop"), ("Close. Score: 3", "stop")]
    encoded = [(tok(text, add_special_tokens=False)["input_ids"], finish) for text, finish in replies]
    monkeypatch.setattr(reward.backend, "_cls", lambda: lambda **_: _Replies(encoded))
    res = reward.score(["41", "43"], ["42"] * 2, prompts=["6*7?"] * 2)
    assert res.scores == pytest.approx([0.8, 0.3]) and res.failed == [False, False]
