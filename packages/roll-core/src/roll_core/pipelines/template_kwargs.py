"""Check `model.chat_template_kwargs` and `data.chat_template_kwargs` against the chat templates that render with them.

Contract: `check_template_kwargs(tokenizer, kwargs, model_path=..., where=...)` looks at every key that no chat template
of the model reads (Jinja renders an unknown name as undefined, so such a key has no effect on any prompt):
- a likely misspelling of a variable some template reads (difflib ratio >= TYPO_CUTOFF: `enable_thinkng`,
  `enable-thinking`, `max_picture`) is a ConfigError naming `model.chat_template_kwargs.<key>`, the variable it was
  likely meant to be and the variables the templates read. Why: a misspelt switch (`enable_thinkng=false`) composed,
  rendered and left Qwen3's thinking on with no word said;
- any other key is one WARNING line naming it (returned too): a legitimate switch of other templates that this one
  simply lacks. The qwen3 / qwen3_moe presets always set `enable_thinking: true`, and the Qwen3 checkpoints whose
  template has no switch (Qwen3-*-Thinking-2507 / Instruct-2507, Qwen3-VL) trained normally with it; refusing it
  refused a key the user never wrote. The cutoff sits above different switch names of the same meaning
  (`thinking` 0.70, `clear_thinking` 0.76, `keep_thinking` 0.79 against `enable_thinking`), which warn.
Keys a template reads pass silently.

`check_config_template_kwargs(tokenizer, cfg, model_path=...)` is what a run calls once its tokenizer is loaded (before
any row is read or model built): the model's keys as above, then the keys `data.chat_template_kwargs` adds to them
(RLVRConfig merges the model's into the data's, so a key with the model's value is the model's, checked once) under
the same rule, named `data.chat_template_kwargs.<key>`, against the tokenizer's templates only (the file-fed
pipelines render their rows with `tokenizer.apply_chat_template`, roll_core.posttrain.chat_encoder). Why: a misspelt
data key (`+data.chat_template_kwargs.enable_thinkng=true`) rendered every SFT/DPO row without the switch, unsaid.

The templates checked are the tokenizer's (a string, a dict of named templates, or the older list of
`{"name", "template"}` entries: a key read by any of them passes) and, for a vision-language folder, the processor's
own template (`processor_config.json`'s, `chat_template.json` or `chat_template.jinja`, picked as transformers picks
it: roll_core.multimodal.templates; roll_core.multimodal.processor renders with it). A model with no
chat template, or one whose template does not parse (its own error comes when it is rendered), is not checked.
The variables are Jinja's undeclared names of the parsed source (jinja2.meta.find_undeclared_variables), so a name
read only as `x is defined` counts as read. Imports jinja2 only when called.
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError

log = logging.getLogger(__name__)

# difflib ratio from which a key no template reads is taken for a misspelling of a variable one reads (refused):
# one or two slipped characters of a switch name score 0.85-0.97, a different name of a similar switch below 0.8.
TYPO_CUTOFF = 0.8


def template_sources(tokenizer: Any, model_path: str | None = None) -> list[str]:
    """Every chat-template source that may render this model's prompts: the tokenizer's (each named one of a dict
    or list) and the processor's own template in the folder `model_path`, when it has one."""
    sources: list[str] = []
    found = getattr(tokenizer, "chat_template", None)
    if isinstance(found, str):
        sources.append(found)
    elif isinstance(found, Mapping):
        sources.extend(v for v in found.values() if isinstance(v, str))
    elif isinstance(found, (list, tuple)):  # the older serialised form: [{"name": ..., "template": ...}]
        sources.extend(t["template"] for t in found if isinstance(t, Mapping) and isinstance(t.get("template"), str))
    if model_path:
        own = _processor_template(Path(model_path))
        if own is not None:
            sources.append(own)
    return sources


def template_variables(source: str) -> set[str] | None:
    """The variables the template `source` reads (its undeclared names); None when it does not parse."""
    import jinja2
    import jinja2.ext
    from jinja2 import meta

    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _generation_tag()])
    try:
        return set(meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateSyntaxError:
        return None


def check_template_kwargs(
    tokenizer: Any,
    kwargs: Mapping[str, Any] | None,
    *,
    model_path: str | None = None,
    where: str = "model.chat_template_kwargs",
) -> list[str]:
    """Check each key of `kwargs` against the variables the chat templates of the model read (template_sources).

    Returns the keys no template reads that were only warned about (one WARNING line each: they have no effect).

    Raises:
        ConfigError: a key no template reads is a likely misspelling of one they read (difflib ratio >=
            TYPO_CUTOFF); it names `<where>.<key>`, the variable it was likely meant to be and those the templates
            read.
    """
    if not kwargs:
        return []
    sources = template_sources(tokenizer, model_path)
    if not sources:
        return []  # no chat template at all: nothing to check the keys against
    read: set[str] = set()
    for source in sources:
        names = template_variables(source)
        if names is None:  # unparsable: rendering says why; no false alarm from here
            return []
        read |= names
    known = sorted(read)
    reads = ", ".join(known) or "no variables"
    typos: list[str] = []
    unused: list[str] = []
    for key in (str(k) for k in kwargs):
        if key in read:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=TYPO_CUTOFF)
        if close:
            hint = f"(did you mean {close[0]}?)"
            typos.append(f"{where}.{key}: the model's chat template reads no variable {key!r} {hint}")
        else:
            unused.append(key)
    if typos:
        typos.append(
            f"the chat template reads: {reads} (an unknown name renders as undefined: the setting would be "
            "silently ignored)"
        )
        raise ConfigError("\n".join(typos))
    for key in unused:
        log.warning(
            "%s.%s: no chat template of this model reads %r, so it has no effect on the %s (the template reads: %s)",
            where,
            key,
            key,
            "rows" if where.startswith("data.") else "prompts",
            reads,
        )
    return unused


def data_own_kwargs(model_kwargs: Mapping[str, Any] | None, data_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keys of `data_kwargs` (data.chat_template_kwargs, into which the model's are merged) that are not the
    model's: absent from `model_kwargs` or given another value there."""
    model = dict(model_kwargs or {})
    return {k: v for k, v in (data_kwargs or {}).items() if k not in model or model[k] != v}


def check_config_template_kwargs(tokenizer: Any, cfg: Any, *, model_path: str | None = None) -> list[str]:
    """Check `cfg.model.chat_template_kwargs` (the prompts: the tokenizer's and the processor's templates) and the
    keys `cfg.data.chat_template_kwargs` adds (the file-fed rows: the tokenizer's templates), see the module doc.

    Returns the warned keys as `<where>.<key>` (each one had its WARNING line).

    Raises:
        ConfigError: a key of either is a likely misspelling of a variable the templates read (named with its place).
    """
    model_kwargs = getattr(getattr(cfg, "model", None), "chat_template_kwargs", None)
    where = "model.chat_template_kwargs"
    warned = [f"{where}.{k}" for k in check_template_kwargs(tokenizer, model_kwargs, model_path=model_path)]
    data_kwargs = getattr(getattr(cfg, "data", None), "chat_template_kwargs", None)
    own = data_own_kwargs(model_kwargs, data_kwargs)
    where = "data.chat_template_kwargs"
    return warned + [f"{where}.{k}" for k in check_template_kwargs(tokenizer, own, where=where)]


def _processor_template(folder: Path) -> str | None:
    """A vision-language processor's own template in `folder`, the one roll_core.multimodal.processor renders with
    (transformers' choice: roll_core.multimodal.templates)."""
    from roll_core.multimodal.templates import processor_template

    return processor_template(folder)


@functools.cache
def _generation_tag() -> type:
    """A parse-only `{% generation %}...{% endgeneration %}` extension (transformers' templates use the tag to
    mark assistant tokens; without it a template using the tag would not parse here)."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return GenerationTag
