"""Check `model.chat_template_kwargs` against the chat template that will render the prompts.

Contract: `check_template_kwargs(tokenizer, kwargs, model_path=...)` raises a ConfigError naming
`model.chat_template_kwargs.<key>` for every key no chat template of the model reads, with a did-you-mean and the
variables the template does read; keys a template reads pass. Why: Jinja renders an unknown name as undefined, so a
misspelt switch (`enable_thinkng=false`) composed, rendered and left thinking on with no word said.

The templates checked are the tokenizer's (a string, a dict of named templates, or the older list of
`{"name", "template"}` entries: a key read by any of them passes) and, for a vision-language folder, the processor's
own `chat_template.jinja` / `chat_template.json` (roll_core.multimodal.processor renders with it). A model with no
chat template, or one whose template does not parse (its own error comes when it is rendered), is not checked.
The variables are Jinja's undeclared names of the parsed source (jinja2.meta.find_undeclared_variables), so a name
read only as `x is defined` counts as read. Imports jinja2 only when called.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError


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
) -> None:
    """ConfigError for each key of `kwargs` that no chat template of the model (see template_sources) reads,
    naming `<where>.<key>`, the closest variable it may have meant and the variables the templates read."""
    if not kwargs:
        return
    sources = template_sources(tokenizer, model_path)
    if not sources:
        return  # no chat template at all: nothing to check the keys against
    read: set[str] = set()
    for source in sources:
        names = template_variables(source)
        if names is None:  # unparsable: rendering says why; no false alarm from here
            return
        read |= names
    unknown = [str(k) for k in kwargs if str(k) not in read]
    if not unknown:
        return
    known = sorted(read)
    lines = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{where}.{key}: the model's chat template reads no variable {key!r}{hint}")
    lines.append(
        f"the chat template reads: {', '.join(known) or 'no variables'} "
        "(an unknown name renders as undefined: the setting would be silently ignored)"
    )
    raise ConfigError("\n".join(lines))


def _processor_template(folder: Path) -> str | None:
    """A vision-language processor's own template in `folder` (as roll_core.multimodal.processor reads it)."""
    if not folder.is_dir():
        return None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = folder / "chat_template.json"
    if js.is_file():
        value = json.loads(js.read_text()).get("chat_template")
        return value if isinstance(value, str) else None
    return None


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
