"""Replies of models whose generation prompt opens the reasoning block.

Contract: some chat templates end the generation prompt with `<think>` (DeepSeek-R1 and its distills, QwQ, the
Qwen3 Thinking-2507 models): the model's reply is the reasoning, `</think>`, then the answer, and carries no
opening tag. Rewards and environments read a reply's answer after its last `</think>`, and treat a reply with an
unclosed `<think>` as cut off while reasoning (no verdict: roll_envs.rewards.judge.final_text). A reply of such a
model cut off mid-reasoning had neither tag and was read whole: a `\\boxed{}` or a tool call in its unfinished
reasoning was graded or acted on. `reply_text` gives rewards and environments the reply as the model wrote it
after its prompt, the opening tag included, when `opens_think` says the prompt opened one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

#: Prompt tokens looked at: a generation header (`<|im_start|>assistant\n<think>\n`, `<｜Assistant｜><think>\n`) is a
#: few tokens; an empty think block of a non-thinking mode (`<think>\n\n</think>\n\n`) closes within them too.
TAIL_TOKENS = 16


def opens_think(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside a `<think>` block its template opened (the last `<think>` of its final
    TAIL_TOKENS tokens is not closed after it)."""
    tail = tokenizer.decode([int(i) for i in list(prompt_ids)[-TAIL_TOKENS:]], skip_special_tokens=False)
    at = tail.rfind(THINK_OPEN)
    return at >= 0 and THINK_CLOSE not in tail[at:]


def reply_text(text: str, opened: bool) -> str:
    """The reply as rewards and environments read it: `<think>` + `text` when the prompt opened the block (and the
    model did not write the tag again), else `text`."""
    if opened and not text.lstrip().startswith(THINK_OPEN):
        return THINK_OPEN + text
    return text
