"""Replies of a model whose generation prompt opens `<think>` (DeepSeek-R1 distills, QwQ, Qwen3 Thinking-2507) reach
rewards and environments with the opening tag (roll_core.thinking). Such a reply carries no `<think>`: cut off
mid-reasoning it had neither tag, and rewards read it whole, grading a `\\boxed{}` of its unfinished reasoning.
Family tokenizers and templates of roll_core.testing.chat_templates; the reward worker's own scoring."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from roll_core.cluster.roles import RewardWorker
from roll_core.interfaces import RewardResult
from roll_core.protocol import Batch
from roll_core.testing.chat_templates import family_tokenizer
from roll_core.thinking import opens_think, reply_text

QUESTION = [{"role": "user", "content": "2+3?"}]


def _prompt(tok: Any, opened: bool, **kwargs: Any) -> list[int]:
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False, **kwargs)
    ids = tok.encode(text, add_special_tokens=False)
    # R1's current template (and QwQ's, Qwen3 Thinking-2507's) ends its generation prompt with "<think>\n"
    return ids + tok.encode("<think>\n", add_special_tokens=False) if opened else ids


def test_a_prompt_that_opens_think_is_told_from_one_that_does_not() -> None:
    r1, qwen3 = family_tokenizer("deepseek_r1"), family_tokenizer("qwen3")
    assert opens_think(r1, _prompt(r1, True))
    assert not opens_think(r1, _prompt(r1, False))
    assert not opens_think(qwen3, _prompt(qwen3, False))  # the model writes <think> itself
    # non-thinking mode: the template's empty block is closed
    assert not opens_think(qwen3, _prompt(qwen3, False, enable_thinking=False))
    assert reply_text("so 5 \\boxed{5}", True) == "<think>so 5 \\boxed{5}"
    assert reply_text("<think>so</think>5", True) == "<think>so</think>5"  # written again by the model: kept
    assert reply_text("so 5", False) == "so 5"


class _Recording:
    """A reward that keeps the texts it was given."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def score(self, responses: list[str], answers: list[Any], **kwargs: Any) -> RewardResult:
        self.seen.extend(responses)
        return RewardResult(
            scores=[0.0] * len(responses), correct=[0.0] * len(responses), formatted=[1.0] * len(responses)
        )


def test_the_reward_worker_hands_rewards_the_reply_with_the_tag_its_prompt_opened() -> None:
    from roll_core.cluster.reward_guard import GuardedReward

    tok = family_tokenizer("deepseek_r1")
    replies = ["2 plus 3 is \\boxed{5}, or is it", "2 plus 3</think>\\boxed{5}"]
    prompts = [_prompt(tok, True), _prompt(tok, False)]
    ids = [tok.encode(r, add_special_tokens=False) for r in replies]
    width = max(map(len, ids))
    batch = Batch(
        {
            "responses": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
            "response_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids]),
        },
        {"answer": ["5", "5"], "prompt_ids": prompts},
    )
    reward = _Recording()
    worker = SimpleNamespace(tokenizer=tok, reward=GuardedReward(reward, isolation="inline"))
    out = RewardWorker.score(worker, batch)
    # cut off while reasoning: the reward sees the open block (no verdict); the other prompt opened none
    assert reward.seen == ["<think>" + replies[0], replies[1]]
    assert out["response_text"] == replies  # the samples log shows what the model wrote


def test_an_environment_reads_each_turn_with_the_tag_the_generation_header_opened() -> None:
    """A multi-turn episode on a template whose generation header opens <think> (R1's current one): each turn's
    reply reaches the environment with it (a reply cut off while reasoning is not taken for an action)."""
    from roll_core.agentic.chat import TurnTemplate
    from roll_core.agentic.env_manager import EnvManager
    from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
    from roll_core.interfaces import SamplingParams

    tok = family_tokenizer("deepseek_r1")
    tok.chat_template = tok.chat_template.replace(
        "{{- '<|Assistant|>' -}}{%- endif -%}", "{{- '<|Assistant|><think>\\n' -}}{%- endif -%}"
    )
    assert tok.chat_template.endswith("<think>\\n' -}}{%- endif -%}")
    seen: list[str] = []

    class Env:
        def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
            return "go", {"state": "0"}

        def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            seen.append(action)
            return "again", 0.0, False, False, {"state": str(len(seen))}

    from concurrent.futures import Future

    from roll_core.interfaces import Request, RequestOutput

    class Engine:
        def submit_request(self, request: Request, route_key: str | None = None) -> Future:
            ids = tok.encode("hmm", add_special_tokens=False)
            fut: Future = Future()
            fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.5] * len(ids), "length"))
            return fut

    limits = EpisodeLimits(max_turns=2, max_context_length=2048, max_tokens_per_turn=8)
    rollout = AgenticRollout(Engine(), EnvManager(Env, 0, step_timeout_s=10), TurnTemplate(tok), tok, limits)
    (traj,) = rollout.run([0], [0], SamplingParams(max_new_tokens=8))
    assert seen == ["<think>hmm", "<think>hmm"] and traj.texts == ["hmm", "hmm"]
