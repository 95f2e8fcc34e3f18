"""Refuse a rollout constraint that would constrain a reasoning model's thinking.

Contract: `refuse_structured_thinking(tokenizer, cfg, model_path=...)` raises ConfigError when
`infer_engine.structured` is set and the chat template that renders the prompts opens a `<think>` block in its
generation prompt without closing it (roll_core.thinking.header_opens_think, rendered with
`model.chat_template_kwargs` as the prompts are: DeepSeek-R1 and its distills, QwQ, Qwen3-*-Thinking-2507,
DeepSeek-V3.1 with `thinking=true`). Why: the engines constrain the whole reply from its first token
(roll_engines.structured), and such a reply is the reasoning, `</think>`, then the answer. A JSON schema never
closes the block (a `</think>` could only fall inside a JSON string), so every reply stayed inside it and the
reward read each one as cut off while reasoning (no verdict: roll_envs.rewards.judge.final_text; every row wrong or
failed), with no word said.
A regex constraint passes when its pattern spells `</think>` (it writes the reasoning's close itself, e.g.
`[\\s\\S]*</think>\\s*[0-9]+`); any other regex is refused as a schema is.
Passes: no constraint; templates without thinking; templates whose generation prompt closes the block (Qwen3 with
`enable_thinking=false` renders `<think>\\n\\n</think>\\n\\n`) or leaves the tag to the model (Qwen3's thinking mode:
the model writes `<think>` itself, which the constraint then simply forbids).
The templates read are the tokenizer's and, in a vision-language folder `model_path`, the processor's own
(roll_core.multimodal.templates), which renders its prompts; a template whose header cannot be rendered on its own
(one that needs other messages) is logged and not refused (the reward worker reads the prompt ids then).
The refusal names both settings and the ways out: each switch of `model.chat_template_kwargs` that closes the
block in this template (`enable_thinking=false`, or a `true` the user set turned `false`) as tried by rendering,
or dropping the constraint. Called where a run has its tokenizer and before any worker starts
(roll_core.pipelines.loop, roll_core.evaluate.tokenizer_and_sampling).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from roll_core.errors import ConfigError
from roll_core.thinking import THINK_CLOSE, header_opens_think

log = logging.getLogger(__name__)

#: Switches tried (with the user's own `true` values turned `false`) to name a way out that closes the block.
_THINKING_OFF: dict[str, Any] = {"enable_thinking": False}


def _writes_close(structured: Mapping[str, Any]) -> bool:
    """Whether the constraint spells `</think>` itself: a regex whose pattern (escapes removed) names it."""
    regex = structured.get("regex")
    return isinstance(regex, str) and THINK_CLOSE in re.sub(r"\\(\W)", r"\1", regex)


def _opens(tokenizer: Any, kwargs: Mapping[str, Any], template: str | None) -> bool | None:
    """header_opens_think of `template` (None: the tokenizer's); None where the header cannot be rendered."""
    try:
        return header_opens_think(tokenizer, (), kwargs, template)
    except Exception as exc:  # a template needing other messages: no verdict here (the reward reads the ids)
        log.warning(
            "infer_engine.structured: the chat template's generation header could not be rendered on its own "
            "(%s: %s): not checked for an open <think> block",
            type(exc).__name__,
            exc,
        )
        return None


def refuse_structured_thinking(tokenizer: Any, cfg: Any, *, model_path: str | None = None) -> None:
    """Raise ConfigError for `infer_engine.structured` on a template whose generation prompt leaves `<think>` open
    (see the module doc); return otherwise."""
    structured = getattr(getattr(cfg, "infer_engine", None), "structured", None)
    if not structured or _writes_close(structured):
        return
    from roll_core.multimodal.templates import processor_template

    kwargs = dict(getattr(getattr(cfg, "model", None), "chat_template_kwargs", None) or {})
    templates: list[str | None] = [None] if getattr(tokenizer, "chat_template", None) else []
    own = processor_template(model_path) if model_path else None
    if own is not None:
        templates.append(own)
    opening = [t for t in templates if _opens(tokenizer, kwargs, t)]
    if not opening:
        return
    switches = {**_THINKING_OFF, **{k: False for k, v in kwargs.items() if v is True}}
    closing = [
        f"+model.chat_template_kwargs.{key}=false"
        for key, off in switches.items()
        if all(_opens(tokenizer, {**kwargs, key: off}, t) is False for t in opening)
    ]
    if closing:
        off = f"turn thinking off ({' or '.join(closing)}: this chat template then closes the block)"
    else:
        off = (
            "turn thinking off where the chat template supports it (model.chat_template_kwargs, e.g. "
            "enable_thinking=false; this template has no switch that closes the block: a thinking-only model, "
            "whose non-thinking variant would do)"
        )
    model = getattr(getattr(cfg, "model", None), "path", None) or model_path
    never = (
        "a regex that does not spell </think> never closes"
        if structured.get("regex") is not None
        else "a JSON schema never closes (a </think> could only fall inside a JSON string)"
    )
    raise ConfigError(
        f"infer_engine.structured={dict(structured)} with a chat template whose generation prompt opens a <think> "
        f"block it does not close (model.path={model}, model.chat_template_kwargs={kwargs}): the constraint "
        f"applies from the reply's first token, i.e. to the model's reasoning, which {never}, so the reward would "
        f"read every reply as cut off while reasoning (no verdict). Either {off}, or drop the constraint (remove "
        "infer_engine.structured), or constrain with a regex that writes the reasoning's close itself "
        "(+infer_engine.structured.regex='[\\s\\S]*</think>\\s*<answer pattern>')"
    )
