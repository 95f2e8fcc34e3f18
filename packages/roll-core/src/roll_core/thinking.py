"""Replies of models whose generation prompt opens the reasoning block.

Contract: some chat templates end the generation prompt with `<think>` (DeepSeek-R1 and its distills, QwQ, the
Qwen3 Thinking-2507 models): the model's reply is the reasoning, `</think>`, then the answer, and carries no
opening tag. Rewards and environments read a reply's answer after its last `</think>`, and treat a reply with an
unclosed `<think>` as cut off while reasoning (no verdict: roll_envs.rewards.judge.final_text). A reply of such a
model cut off mid-reasoning had neither tag and was read whole: a `\\boxed{}` or a tool call in its unfinished
reasoning was graded or acted on. `reply_text` gives rewards and environments the reply as the model wrote it
after its prompt, the opening tag included, when the prompt opened one.

Which prompts open one. `header_opens_think` asks the chat template itself: its generation header (the text it
writes after the last message's content, up to where the model starts) opens `<think>` and does not close it. An
agentic episode reads it once per template (roll_core.agentic.rollout): an observation is untrusted text, and
one whose last ids spell `<think>` (an added token that is not the template's framing keeps its id there, as at
inference: roll_core.agentic.turn_text) sat within the ids `opens_think` reads, so the environment took the next
reply for unfinished reasoning; a tag in a user or tool turn opens nothing, the header decides.
`opens_think` reads a prompt's last TAIL_TOKENS ids, for callers that have the ids and no template. The reward
worker (roll_core.cluster.roles) uses both: a row opens `<think>` when the template's header opens it and the
prompt's ids still end inside the block (a dataset prompt whose user text ends in `<think>` no longer counts); a
tokenizer without a usable template falls back to the ids alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

#: Prompt tokens looked at: a generation header (`<|im_start|>assistant\n<think>\n`, `<｜Assistant｜><think>\n`) is a
#: few tokens; an empty think block of a non-thinking mode (`<think>\n\n</think>\n\n`) closes within them too.
TAIL_TOKENS = 16


#: The content of the last message when a template's generation header is read (no template writes it).
_SENTINEL = "\u2063ROLL-HEADER\u2063"


def _leaves_open(text: str) -> bool:
    """Whether `text`'s last `<think>` is not closed after it."""
    at = text.rfind(THINK_OPEN)
    return at >= 0 and THINK_CLOSE not in text[at:]


def opens_think(tokenizer: Any, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside a `<think>` block its template opened (the last `<think>` of its final
    TAIL_TOKENS tokens is not closed after it). Text of the prompt's last message within those tokens counts too:
    where the template is known, `header_opens_think` reads its header alone."""
    return _leaves_open(tokenizer.decode([int(i) for i in list(prompt_ids)[-TAIL_TOKENS:]], skip_special_tokens=False))


def header_opens_think(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]] = (),
    chat_template_kwargs: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
) -> bool:
    """Whether the chat template's own generation header opens a `<think>` block it does not close: the text it
    renders after a user message's content (that turn's closing, the assistant header) when the user message
    follows `messages`, rendered with `chat_template_kwargs` (and `chat_template` in place of the tokenizer's). No
    message's content is read: a `<think>` an observation spells does not count."""
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    convo = [*(dict(m) for m in messages), {"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True, **kwargs)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render a user message's content once, verbatim")
    return _leaves_open(text[text.index(_SENTINEL) + len(_SENTINEL) :])


def reply_text(text: str, opened: bool) -> str:
    """The reply as rewards and environments read it: `<think>` + `text` when the prompt opened the block (and the
    model did not write the tag again), else `text`."""
    if opened and not text.lstrip().startswith(THINK_OPEN):
        return THINK_OPEN + text
    return text


def reasoning_span(text: str, call_open: str, call_end: Callable[[str, int], int]) -> tuple[int, int]:
    """(opening, close) of a reply's reasoning block: the index of its `<think>` (-1 without one) and of the
    `</think>` that ends it (-1 when none does: cut off), scanning past tool-call blocks: a block starts at
    `call_open`, and `call_end(text, at)` is the index just past the block starting at `at` (-1 when it does not
    end: only its opening marker is skipped). A think marker inside a call's argument is the argument's, not the
    reply's reasoning (the tool-call parsers of roll_core.agentic._tool_calls and roll_envs' tool env)."""
    pos, opening = 0, -1
    while True:
        found = {
            "close": text.find(THINK_CLOSE, pos),
            "call": text.find(call_open, pos),
            "open": text.find(THINK_OPEN, pos) if opening < 0 else -1,
        }
        found = {k: i for k, i in found.items() if i >= 0}
        if not found:
            return opening, -1
        kind = min(found, key=found.__getitem__)
        at = found[kind]
        if kind == "close":
            return opening, at
        if kind == "open":
            opening, pos = at, at + len(THINK_OPEN)
            continue
        end = call_end(text, at)
        pos = end if end >= 0 else at + len(call_open)
