"""Token-in-token-out chat turns and the trajectory batch layout (holes in the loss mask)."""

from __future__ import annotations

import pytest
import torch

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.trajectory import Trajectory, to_tensors
from roll_core.models import build_tiny_tokenizer

CHATML = (  # like SmolLM2's and Qwen's: a default system prompt when none is given
    "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(params=["tiny", "chatml"])
def tokenizer(request: pytest.FixtureRequest):
    tok = build_tiny_tokenizer()
    if request.param == "chatml":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.eos_token = "<|im_end|>"
        tok.chat_template = CHATML
    return tok


def test_appended_turns_equal_the_rendered_conversation(tokenizer) -> None:
    """initial + response + observation + response ... decodes to exactly the template's rendering, while the
    response ids stay the ones generated (never re-tokenised)."""
    t = TurnTemplate(tokenizer, system_prompt="Play well.")
    eos = tokenizer.eos_token_id
    first = t.initial("board 1")
    reply1 = tokenizer("move left", add_special_tokens=False)["input_ids"] + [eos]  # stopped at end-of-turn
    obs = t.observation("board 2", reply1)
    reply2 = tokenizer("move up", add_special_tokens=False)["input_ids"]  # cut off: no end-of-turn token
    obs2 = t.observation("board 3", reply2)
    text = tokenizer.decode(first + reply1 + obs + reply2 + obs2)
    expected = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Play well."},
            {"role": "user", "content": "board 1"},
            {"role": "assistant", "content": "move left"},
            {"role": "user", "content": "board 2"},
            {"role": "assistant", "content": "move up"},
            {"role": "user", "content": "board 3"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.replace("</s>", "") == expected.replace("</s>", "")


def test_batch_layout_has_holes_and_turns() -> None:
    a = Trajectory(env_seed=1, group=0, prompt_ids=[5, 6])
    a.add_response([10, 11], [-0.1, -0.2])
    a.state_keys.append("s0")
    a.turn_rewards.append(0.0)
    a.add_observation([20, 21, 22])
    a.add_response([12], [-0.3])
    a.state_keys.append("s1")
    a.turn_rewards.append(1.0)
    b = Trajectory(env_seed=1, group=0, prompt_ids=[7])
    b.add_response([13], [-0.4])
    b.turn_rewards.append(0.0)
    t = to_tensors([a, b], pad_id=0)
    assert t["responses"].tolist() == [[10, 11, 20, 21, 22, 12], [13, 0, 0, 0, 0, 0]]
    assert t["response_mask"].tolist() == [[1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0]]
    assert t["turn_ids"].tolist() == [[0, 0, -1, -1, -1, 1], [0, -1, -1, -1, -1, -1]]
    torch.testing.assert_close(t["behaviour_logprobs"][0], torch.tensor([-0.1, -0.2, 0, 0, 0, -0.3]))
    # observations are attended (they are context), padding is not; prompts left-padded
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert t["turn_rewards"].tolist() == [[0.0, 1.0], [0.0, 0.0]] and t["turn_mask"].tolist() == [[1, 1], [1, 0]]
    assert t["episode_rewards"].tolist() == [1.0, 0.0] and t["state_keys"] == [["s0", "s1"], []]
