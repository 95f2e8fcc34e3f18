"""Which chat template a vision-language model folder's processor renders with: `processor_template(folder)`.

The rule is transformers' own (5.x `ProcessorMixin.get_processor_dict` on a local folder), so roll, transformers'
`AutoProcessor` and vLLM (which takes the processor's template before the tokenizer's) render the same prompts from
the same folder:
1. a `chat_template` key in `processor_config.json` (an old layout transformers still honours, with a warning);
2. else `chat_template.json` (the hub's legacy processor file: transformers reads it before the newer file);
3. else `chat_template.jinja`;
4. else None: the tokenizer's template (`tokenizer_config.json`) renders.
roll read `chat_template.jinja` first: a folder holding both files with different templates (transformers 5 saves
the tokenizer's template as `chat_template.jinja` beside a hub processor's `chat_template.json`) rendered roll's
prompts with one template and transformers' and vLLM's with the other.

Imports nothing but the standard library (config checks read it: roll_core.pipelines.template_kwargs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def processor_template(folder: str | Path) -> str | None:
    """The processor's own chat template in the model folder `folder` (the module docstring's order), or None
    when it has none (or `folder` is no folder: a hub id)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    config = folder / "processor_config.json"
    if config.is_file():
        found = _template(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
        if found is not None:
            return found
    legacy = folder / "chat_template.json"
    if legacy.is_file():
        return _template(json.loads(legacy.read_text(encoding="utf-8")).get("chat_template"))
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return None


def _template(value: Any) -> str | None:
    """A template value as transformers stores it: a string, or named templates whose `default` renders."""
    if isinstance(value, dict):
        value = value.get("default")
    return value if isinstance(value, str) else None
