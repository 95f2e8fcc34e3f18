"""Replies of a model whose generation prompt opens `<think>` (DeepSeek-R1 distills, QwQ, Qwen3 Thinking-2507) reach
rewards and environments with the opening tag (roll_core.thinking). Such a reply carries no `<think>`: cut off
mid-reasoning it had neither tag, and rewards read it whole, grading a `\\boxed{}` of its unfinished reasoning.
Family tokenizers and templates of roll_core.testing.chat_templates; the reward worker's own scoring, which asks the
template's generation header (roll_core.thinking.header_opens_think, with model.chat_template_kwargs): a dataset
prompt whose user text ends with `<think>` opens nothing, and the reward group hands the worker the prompt ids."""

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
    # R1's current template's header opens <think> (template_opens_think, test_a_dataset_prompt_...); the second
    # prompt's ids do not end inside the block
    worker = SimpleNamespace(tokenizer=tok, reward=GuardedReward(reward, isolation="inline"), header_opens_think=True)
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


ARITHMETIC = {
    "_target_": "roll_envs.tasks.arithmetic.ArithmeticTask",
    "digits": 1,
    "eval_size": 10,
    "reward": {"_target_": "roll_envs.rewards.math.MathReward", "format_weight": 0.0},
}


def _batch(tok: Any, prompts: list[list[int]], replies: list[str]) -> Batch:
    ids = [tok.encode(r, add_special_tokens=False) for r in replies]
    width = max(map(len, ids))
    return Batch(
        {
            "responses": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
            "response_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids]),
        },
        {"answer": ["5"] * len(ids), "prompt_ids": prompts},
    )


def test_a_dataset_prompt_whose_user_text_ends_with_think_opens_nothing(tmp_path: Any) -> None:
    """Qwen3 (`<think>` an added token that keeps its id in a user's text; the model writes the tag itself): a
    prompt whose user text ends with `<think>` held it within the ids `opens_think` reads, and the reward got
    `<think>` + the reply: an answer read as unfinished reasoning, graded wrong."""
    tok = family_tokenizer("qwen3")
    tok.add_tokens(["user", "assistant"])  # one id each, as in Qwen's vocabulary (a shorter header)
    tok.save_pretrained(tmp_path)
    worker = RewardWorker(ARITHMETIC, str(tmp_path))
    assert worker.header_opens_think is False
    question = [{"role": "user", "content": "What is 2+3? Reason in <think>"}]
    prompt = list(tok.apply_chat_template(question, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert tok.convert_tokens_to_ids("<think>") in prompt[-16:] and opens_think(tok, prompt)  # the ids alone: open
    out = RewardWorker.score(worker, _batch(tok, [prompt], ["so \\boxed{5}"]))
    assert out["correct"].tolist() == [1.0] and out["scores"].tolist() == [1.0]


def test_the_reward_group_reads_the_header_with_the_models_template_kwargs(tmp_path: Any) -> None:
    """A template whose header opens <think> only with a kwarg (DeepSeek-V3.1's `thinking`): the prompts rendered
    with it open the block, and a reply cut off while reasoning has no answer; rendered without, the same reply is
    graded. The reward group passed the workers no prompt ids (the tag was never put back in a run)."""
    from roll_core.cluster.roles import RewardGroup, template_opens_think

    tok = family_tokenizer("deepseek_r1")
    header = "{%- if add_generation_prompt -%}{{- '<|Assistant|>' -}}{%- endif -%}"
    assert header in tok.chat_template
    tok.chat_template = tok.chat_template.replace(
        header,
        "{%- if add_generation_prompt -%}{{- '<|Assistant|>' -}}"
        "{%- if thinking is defined and thinking -%}{{- '<think>\\n' -}}{%- endif -%}{%- endif -%}",
    )
    tok.save_pretrained(tmp_path)
    assert template_opens_think(tok, {"thinking": True}) and not template_opens_think(tok)
    cut_off = "2 plus 3 is \\boxed{5}, or is it"
    scored = {}
    for kwargs in ({"thinking": True}, {}):
        prompt = _prompt(tok, False, **kwargs)
        group = RewardGroup(
            RewardWorker, 1, "local", env=ARITHMETIC, tokenizer_path=str(tmp_path), chat_template_kwargs=kwargs
        )
        try:
            out = group.score(_batch(tok, [prompt], [cut_off]))
        finally:
            group.shutdown()
        scored[bool(kwargs)] = out["correct"].tolist()
        assert out["response_text"] == [cut_off]
    assert scored == {True: [0.0], False: [1.0]}
