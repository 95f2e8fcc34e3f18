"""Row values: one row's columns checked and normalised into what tokenisation takes, or a counted `SkipRow`.

Contract: every function here reads values of one row (no tokenizer, no template) and returns them in the form the
chat template and the tokenizer take (messages as dicts with a `role` and text `content`, tool schemas and tool calls
as lists of mappings, token ids as ints), or raises `SkipRow` with a short reason code and a detail naming the column
(`missing_field`, `wrong_type`, `empty`, `bad_token_id`, `bad_text`, `unknown_role`). Nothing here drops or renames
a value silently: what cannot be read as the data means it is a skip.

- `need(row, key)`: the value, or `missing_field`.
- `check_text(value, key)`: non-blank text (`wrong_type`, `empty`); text holding a lone UTF-16 surrogate (half of
  an escaped pair, "\\ud83d" without its partner: the tokenizer refuses it) is `bad_text`, in any text this module
  reads (message contents, tool calls, tool schemas).
- `check_ids(value, key, vocab)`: token ids in [0, vocab).
- `check_messages(value, key)`: a non-empty list of messages (an empty list is `empty`, as blank text is).
  Parquet's absent-field Nones are dropped; `tool_calls` given as JSON text are parsed, and each call must name its
  function (`tool_call_names`). ShareGPT messages (`{"from", "value"}`, as LLaMA-Factory's `sharegpt` format writes
  them) are read by `sharegpt_message`: `from` human / gpt / system / function_call / observation (and the chat
  roles user / assistant / system / tool) become user / assistant / system, an assistant message whose `tool_calls`
  are the JSON of a `function_call` turn (a call `{"name", "arguments"}` or a list of them), and a `tool` message;
  any other `from` is an `unknown_role` skip naming it (it was kept as the role: a template rendered a turn of that
  name, or the row lost its answer).
  Roles (`role_rule`): `KNOWN_ROLES` are the four chat roles and those of tool-calling templates (developer,
  function, ipython, observation). Another data set's name for one (`ROLE_ALIASES`: human, gpt, Gemma's model;
  exactly those names, but for case and surrounding spaces: "Human", " GPT") is read as the role it names
  (`role_alias`: human -> user, gpt / model -> assistant), as ShareGPT's `from` is, so the row renders and trains
  as one written with the standard roles; `renamed_roles` names the renames a row's messages take, which the
  loader counts per example ("human->user") and reports. A role that is a known one but for case, spaces or a
  small misspelling ("Assistant", "assitant", "usr", "sytem": an edit distance of 1 from a role of up to 5
  letters, 2 from a longer one) is an `unknown_role` skip naming the role meant: a guess, not a name (the template
  rendered it under a header of its own as untrained context, so a misspelt assistant turn was never trained,
  without a word). Any other role (a template's own, e.g. "critic") is kept, as context; the loader counts the
  examples holding one (`other_roles`) and warns once per role. A blank role is `wrong_type`.
- `row_messages(row, messages_key)`: the messages of a `messages` row (or its ShareGPT `conversations` column), with
  LLaMA-Factory's `system` column (text beside ShareGPT messages) put first as a system message; a row with both
  that column and a different leading system turn is a `wrong_type` skip (which one the data means is unknown).
- `check_tools(value)`: a row's `tools` column (a list of schemas, or its JSON text; None when absent or empty),
  each schema in OpenAI's form `{"type": "function", "function": {"name", "description", "parameters"}}`, the form
  transformers' `get_json_schema` gives `apply_chat_template(tools=...)` and chat templates read
  (`tool.function.name`): a flat schema `{"name", "description", "parameters"}` (LLaMA-Factory's, many datasets')
  is wrapped so (it was passed as it was: Qwen2.5's template showed the model a schema of another shape than it
  was trained on, templates reading `tool.function` failed or showed nothing); a schema naming no function is a
  `wrong_type` skip.
- `chat_messages(value, key)`: a message list with its ShareGPT messages read as chat messages and its role aliases as
  the roles they name (anything else as it is): for code that compares messages before `check_messages` runs (the
  preference rows' prompt).
- `train_flag(message)`: whether an assistant message is trained (`train` true / false, OpenAI's `weight` 0 / 1).
- `blank(message)`: whether a message says nothing (blank text and no tool calls).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from roll_core.posttrain.rows import SkipRow

__all__ = [
    "KNOWN_ROLES",
    "ROLE_ALIASES",
    "SHAREGPT_COLUMN",
    "SHAREGPT_ROLES",
    "SHAREGPT_SYSTEM_COLUMN",
    "blank",
    "chat_messages",
    "check_ids",
    "check_messages",
    "check_text",
    "check_tools",
    "messages_column",
    "need",
    "other_roles",
    "renamed_roles",
    "role_alias",
    "role_rule",
    "row_messages",
    "sharegpt_message",
    "tool_call_names",
    "train_flag",
]

SHAREGPT_COLUMN = "conversations"
SHAREGPT_SYSTEM_COLUMN = "system"  # LLaMA-Factory's system prompt column beside ShareGPT conversations
# `from` values to roles; function_call and observation are handled by `sharegpt_message` (a call and a tool result)
SHAREGPT_ROLES = {
    "human": "user",
    "gpt": "assistant",
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}
_SURROGATE = re.compile("[\ud800-\udfff]")
#: Roles chat templates render: OpenAI's four (only `assistant` turns are trained), OpenAI's `developer` and legacy
#: `function`, Llama 3.1's `ipython`, GLM's `observation` (tool results).
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython", "observation")
#: Other data sets' names for a chat role, as a `role` (ShareGPT's as `from` are read by `sharegpt_message`; Gemma's
#: template calls the assistant `model`): read as the role they name (`role_alias`), as Axolotl's role maps do.
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant"}


def need(row: Mapping[str, Any], key: str) -> Any:
    """row[key], or a `missing_field` skip (the column absent, or null)."""
    value = row.get(key)
    if value is None:
        # a null said as null: "no 'chosen' (the row has ['chosen', ...])" contradicted itself
        what = f"{key!r} is null" if key in row else f"no {key!r}"
        raise SkipRow("missing_field", f"{what} (the row has {sorted(row)[:10]})")
    return value


def _check_unicode(value: Any, where: str) -> None:
    """A `bad_text` skip when any text in `value` (nested lists and mappings too) holds a lone surrogate."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found:
            raise SkipRow(
                "bad_text",
                f"{where} holds a lone UTF-16 surrogate {found.group()!r} at character {found.start()} (half of an "
                "escaped pair such as \\ud83d\\ude00, the other half lost): not text a tokenizer can encode",
            )
    elif isinstance(value, Mapping):
        for v in value.values():
            _check_unicode(v, where)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_unicode(v, where)


def check_text(value: Any, key: str) -> str:
    """Non-blank text without lone surrogates, or a skip (`wrong_type`, `empty`, `bad_text`)."""
    if not isinstance(value, str):
        raise SkipRow("wrong_type", f"{key!r} must be non-empty text or a list of messages, got {str(value)[:60]}")
    if not value.strip():
        raise SkipRow("empty", f"{key!r} is blank ({value!r})")
    _check_unicode(value, repr(key))
    return value


def check_ids(value: Any, key: str, vocab: int, *, allow_empty: bool = False) -> list[int]:
    """A list of token ids in [0, vocab), or a skip (`wrong_type`, `bad_token_id`, `empty`)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise SkipRow("wrong_type", f"{key!r} must be a list of integer token ids, got {str(value)[:60]}")
    if not value and not allow_empty:
        raise SkipRow("empty", f"{key!r} is empty")
    bad = [x for x in value if not 0 <= x < vocab]
    if bad:
        raise SkipRow("bad_token_id", f"{key!r} holds id {bad[0]} outside the vocabulary [0, {vocab})")
    return [int(x) for x in value]


def _is_sharegpt(m: Any) -> bool:
    return isinstance(m, Mapping) and "role" not in m and isinstance(m.get("from"), str)


def sharegpt_message(m: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A ShareGPT message (`{"from", "value"}`) as a chat message (see the module doc); an `unknown_role` skip for
    a `from` it does not know, a `wrong_type` skip for a function_call whose value is not a call's JSON."""
    source = m["from"]
    role = SHAREGPT_ROLES.get(source)
    if role is None:
        known = ", ".join(sorted(SHAREGPT_ROLES))
        raise SkipRow("unknown_role", f"{where} is from {source!r}: a ShareGPT message is from one of {known}")
    rest = {k: v for k, v in m.items() if k not in ("from", "value")}
    value = m.get("value")
    if source != "function_call":
        return {**rest, "role": role, "content": value}
    # LLaMA-Factory: the assistant's tool call(s) as JSON text, {"name", "arguments"} or a list of them
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        text = value[:60]
        raise SkipRow("wrong_type", f"{where} (function_call) is not JSON ({exc.msg}): {text!r}") from None
    calls = [calls] if isinstance(calls, Mapping) else calls
    if not isinstance(calls, list) or not calls or not all(isinstance(c, Mapping) and "name" in c for c in calls):
        why = f"{where} (function_call) must be a call's JSON, {{'name', 'arguments'}} or a list of them"
        raise SkipRow("wrong_type", f"{why}, got {str(value)[:60]}")
    tool_calls = [
        {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls
    ]
    return {**rest, "role": role, "content": "", "tool_calls": tool_calls}


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance with adjacent transpositions ("assitsant"), by dynamic programming."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def role_alias(role: str) -> str | None:
    """The standard role `role` names when it is one of `ROLE_ALIASES`, but for case and surrounding spaces
    ("Human", "gpt ", "MODEL"), else None (a known role, a misspelling, any other name)."""
    return None if role in KNOWN_ROLES else ROLE_ALIASES.get(role.strip().casefold())


def renamed_roles(*values: Any) -> tuple[str, ...]:
    """The renames ("human->user", sorted, each once) that `check_messages` / `chat_messages` make reading the
    message lists among `values` (text and anything else name none; ShareGPT's `from` is its format's own)."""
    found = set()
    for value in values:
        for m in value if isinstance(value, (list, tuple)) else ():
            role = m.get("role") if isinstance(m, Mapping) else None
            if isinstance(role, str) and (meant := role_alias(role)) is not None:
                found.add(f"{role.strip().casefold()}->{meant}")
    return tuple(sorted(found))


def role_rule(role: str) -> str | None:
    """The known role a message's `role` was likely meant as (see the module doc): the one an alias names
    (`role_alias`, which `check_messages` reads it as) or a misspelling's (an `unknown_role` skip); None for a known
    role, or one unlike any (kept as context, counted by `other_roles`)."""
    if role in KNOWN_ROLES:
        return None
    alias = role_alias(role)
    if alias is not None:
        return alias
    word = role.strip().casefold()
    near = []
    for known in KNOWN_ROLES:
        # one edit for a short role: two would take "toy" or "tone" for "tool"
        if abs(len(word) - len(known)) <= 2 and (d := _edit_distance(word, known)) <= (1 if len(known) <= 5 else 2):
            near.append((d, known))
    return min(near)[1] if near else None


def other_roles(messages: list[dict[str, Any]]) -> tuple[str, ...]:
    """The roles of `messages` that are not `KNOWN_ROLES` (sorted, each once): rendered as context, never trained."""
    return tuple(sorted({m["role"] for m in messages} - set(KNOWN_ROLES)))


def check_messages(value: Any, key: str) -> list[dict[str, Any]]:
    """A non-empty list of chat messages (ShareGPT's read as such), each with a role and text content (None only
    beside tool calls), or a skip (see the module doc)."""
    if isinstance(value, (list, tuple)) and not value:  # an empty completion, as blank text is
        raise SkipRow("empty", f"{key!r} is an empty list of messages")
    if not isinstance(value, (list, tuple)):
        raise SkipRow("wrong_type", f"{key!r} must be a non-empty list of messages, got {str(value)[:60]}")
    out = []
    for i, m in enumerate(value):
        if _is_sharegpt(m):
            m = sharegpt_message(m, f"{key!r}[{i}]")
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m["role"].strip():
            raise SkipRow("wrong_type", f"{key!r}[{i}] is not a message with a 'role' ({str(m)[:60]})")
        if (alias := role_alias(m["role"])) is not None:  # another data set's name for the role: counted by the loader
            m = {**m, "role": alias}
        meant = role_rule(m["role"])
        if meant is not None:
            lost = "a turn roll never trains" if meant == "assistant" else f"not a {meant!r} turn"
            raise SkipRow(
                "unknown_role",
                f"{key!r}[{i}] has role {m['role']!r}: {meant!r} meant? The chat template renders it under a header "
                f"of its own ({lost}); write {meant!r}",
            )
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise SkipRow("wrong_type", f"{key!r}[{i}] content is {type(content).__name__}, expected text")
        # Parquet / datasets give every message every column of the struct (None where absent): drop those.
        message = {k: v for k, v in m.items() if v is not None or k == "content"}
        if "tool_calls" in message:
            message["tool_calls"] = _json_list(message["tool_calls"], f"{key!r}[{i}] 'tool_calls'", "tool calls")
            tool_call_names(message)  # a call naming no function: this row's fault, said before any template runs
        _check_unicode([message.get("content"), message.get("tool_calls")], f"{key!r}[{i}]")
        out.append(message)
    return out


def messages_column(row: Mapping[str, Any], messages_key: str) -> str:
    """The column a `messages` row's messages are read from: `messages_key`, or ShareGPT's `conversations` when the
    row has only that."""
    return messages_key if messages_key in row or SHAREGPT_COLUMN not in row else SHAREGPT_COLUMN


def row_messages(row: Mapping[str, Any], messages_key: str) -> list[dict[str, Any]]:
    """The checked messages of a `messages` row: the `messages_key` column, or ShareGPT's `conversations` when the
    row has no `messages_key`; beside ShareGPT messages, a text `system` column becomes the first message."""
    key = messages_column(row, messages_key)
    value = need(row, key)
    messages = check_messages(value, key)
    system = row.get(SHAREGPT_SYSTEM_COLUMN)
    if system is None or not isinstance(value, (list, tuple)) or not any(_is_sharegpt(m) for m in value):
        return messages
    if not isinstance(system, str):
        raise SkipRow("wrong_type", f"{SHAREGPT_SYSTEM_COLUMN!r} must be text, got {str(system)[:60]}")
    if not system.strip():
        return messages
    _check_unicode(system, repr(SHAREGPT_SYSTEM_COLUMN))
    if messages[0]["role"] == "system":
        if messages[0]["content"] == system:
            return messages
        raise SkipRow(
            "wrong_type",
            f"the row has a {SHAREGPT_SYSTEM_COLUMN!r} column and {key!r} starts with a different system message: "
            "which system prompt the row means is unknown",
        )
    return [{"role": "system", "content": system}, *messages]


def check_tools(value: Any) -> list[dict[str, Any]] | None:
    """A row's `tools` column as a chat template takes it: a list of tool schemas (None when absent or empty). The
    list may be JSON text (datasets store it so, one schema per Arrow column being impossible): transformers
    refused that text with an error naming neither the column nor the row. Anything else is a `wrong_type` skip."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    tools = _json_list(value, "'tools'", "tool schemas") or None
    _check_unicode(tools, "'tools'")
    return [_openai_tool(t) for t in tools] if tools else None


def _openai_tool(schema: dict[str, Any]) -> dict[str, Any]:
    """One tool schema in OpenAI's form (see the module doc), or a `wrong_type` skip when it names no function."""
    function = schema.get("function")
    if isinstance(function, Mapping):
        name = function.get("name")
    elif schema.get("type", "function") == "function" and "function" not in schema:
        name = schema.get("name")
        function = {k: v for k, v in schema.items() if k != "type"}
        schema = {"type": "function", "function": function}
    else:
        name = None
    if not isinstance(name, str) or not name.strip():
        raise SkipRow(
            "wrong_type",
            "a tool schema names no function: expected {'name', 'description', 'parameters'} or OpenAI's "
            f"{{'type': 'function', 'function': {{'name', ...}}}}, got {str(schema)[:60]}",
        )
    return schema


def chat_messages(value: Any, key: str) -> Any:
    """`value` with its ShareGPT messages read as chat messages (`sharegpt_message`) and its role aliases as the
    roles they name (`role_alias`), when it is a list; anything else as it is (what it may hold is
    `check_messages`' to say)."""
    if not isinstance(value, (list, tuple)):
        return value
    return [_standard_role(sharegpt_message(m, f"{key!r}[{i}]") if _is_sharegpt(m) else m) for i, m in enumerate(value)]


def _standard_role(m: Any) -> Any:
    """A message with an aliased role (`role_alias`) as one with the role it names; anything else as it is."""
    role = m.get("role") if isinstance(m, Mapping) else None
    alias = role_alias(role) if isinstance(role, str) else None
    return m if alias is None else {**m, "role": alias}


def _json_list(value: Any, where: str, what: str) -> list[dict[str, Any]]:
    """`value` as a list of mappings, parsing JSON text; a `wrong_type` skip naming `where` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SkipRow("wrong_type", f"{where} is text that is not JSON ({exc.msg}): {value[:60]!r}") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, Mapping) for v in value):
        raise SkipRow("wrong_type", f"{where} must be a list of {what} (or that list as JSON), got {str(value)[:60]}")
    return [dict(v) for v in value]


def tool_call_names(message: Mapping[str, Any]) -> list[str]:
    """The function names of a message's tool calls (OpenAI's `{"function": {"name", ...}}` or a flat
    `{"name", ...}`); a `wrong_type` skip for a call without one."""
    names = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call.get("function"), Mapping) else call
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise SkipRow("wrong_type", f"a tool call names no function ({str(call)[:60]})")
        names.append(name)
    return names


def blank(message: Mapping[str, Any]) -> bool:
    """Whether a message says nothing: text content that is empty or whitespace, and no tool calls."""
    content = message.get("content")
    return isinstance(content, str) and not content.strip() and not message.get("tool_calls")


def train_flag(message: Mapping[str, Any]) -> bool:
    """A message's `train` flag: true, false, or absent/null (trained); any other value is a counted skip (`0` or
    `"false"` read as true would train a turn the data says not to). OpenAI's fine-tuning files say the same with
    `"weight": 0` or `1` on assistant messages: read alike (it was ignored, and a turn weighted 0 trained); a
    weight of another value, or one that contradicts `train`, is a counted skip."""
    flag = message.get("train")
    if flag is not None and not isinstance(flag, bool):
        raise SkipRow("wrong_type", f"a message's 'train' is {flag!r}: use true or false")
    weight = message.get("weight")
    if weight is None:
        return flag is not False
    if isinstance(weight, bool) or weight not in (0, 1):
        raise SkipRow("wrong_type", f"a message's 'weight' is {weight!r}: OpenAI's format takes 0 or 1")
    if flag is not None and flag != bool(weight):
        raise SkipRow("wrong_type", f"a message says 'train': {flag} and 'weight': {weight}")
    return bool(weight)
