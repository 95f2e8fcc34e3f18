"""JSON-schema checks of roll_engines.structured: a schema is compiled (outlines-core's `build_regex_from_schema`)
only when the regex it becomes constrains to values the schema allows, and to valid JSON.

outlines-core (0.2) reads one keyword per (sub)schema, in a fixed order (`properties`, `allOf`, `anyOf`, `oneOf`,
`prefixItems`, `enum`, `const`, `$ref`, `type`; for a string: `minLength`/`maxLength`, else `pattern`, else `format`),
and drops whatever else sits beside it without a word: `{"type": "integer", "enum": [1, "x"]}` samples "x",
`{"type": "object", "required": ["a"]}` samples `{}`, a pattern beside a maxLength is not enforced. It writes a
`pattern` (and some `format` regexes: email, uri, time) between the quotes of a JSON string unescaped, so a pattern
matching '"', '\\' or a control character samples text that is not JSON, and an alternation 'a|b' binds to the
quotes ('"a' or 'b"'). It samples `oneOf` as `anyOf`. Each is refused here, naming the keyword and its place, or
(an unanchored alternation in a pattern) rewritten to the language meant.

It also writes the any-value schema `{}` as an ungrouped alternation, so a property, tuple item or
additionalProperties value `{}` bound its '|' to the text around it (`{"properties": {"a": {}}}` sampled `null` or
`{"a":true` without its '}'): each `{}` below the root is given as `{"anyOf": [{}]}`, which it groups. An empty
`enum` / `anyOf` / `oneOf` / `allOf` / `type` list (no value valid) became the empty regex (an empty response, or
`{"a":}`): refused. A recursive `$ref` is expanded `_MAX_REF_DEPTH` levels deep, then the property holding it is
dropped: a required one left objects without it and with a trailing comma (`{"v":1,}`, not JSON): refused.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

#: Restricting keywords outlines-core's regex builder drops wherever they stand: the regex of a schema holding one
#: accepts values the schema forbids ({"type": "integer", "minimum": 0} lets "-3" through).
UNENFORCED = frozenset(
    {
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems", "contains",
        "minContains", "maxContains", "maxProperties", "patternProperties", "propertyNames", "dependentRequired",
        "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems", "not", "if", "then", "else",
    }
)  # fmt: skip

_ALL = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})
#: The instance types a restricting keyword applies to (JSON Schema validation: a string keyword is vacuous for a
#: number). Dropping one matters only where the sampled value can be of such a type.
_APPLIES = {
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), frozenset({"string"})),
    **dict.fromkeys(("items", "prefixItems", "minItems", "maxItems"), frozenset({"array"})),
    **dict.fromkeys(
        ("properties", "required", "additionalProperties", "minProperties", "maxProperties"), frozenset({"object"})
    ),
    **dict.fromkeys(("type", "enum", "const", "allOf", "anyOf", "oneOf", "$ref"), _ALL),
}
#: outlines-core's dispatch order: the first of these a schema holds decides its regex.
_ORDER = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref", "type")
#: Bytes a pattern or format must not match: outlines-core writes its text between a JSON string's quotes as is.
_UNSAFE_BYTES = frozenset({0x22, 0x5C, *range(0x20)})


def _fail(where: str, what: str, why: str) -> None:
    raise ValueError(
        f"StructuredOutput.json_schema: {what} at {where} would not be enforced ({why}; sampling would produce values "
        "the schema forbids)"
    )


def _types(schema: dict[str, Any]) -> frozenset[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return frozenset({t})
    if isinstance(t, list):
        return frozenset(x for x in t if isinstance(x, str))
    return _ALL


def _type_of(value: Any) -> frozenset[str]:
    """The JSON types `value` has (an integral number is both integer and number)."""
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, (int, float)):
        return frozenset({"integer", "number"}) if float(value).is_integer() else frozenset({"number"})
    if isinstance(value, str):
        return frozenset({"string"})
    return frozenset({"array"}) if isinstance(value, list) else frozenset({"object"})


def _fits(value_types: frozenset[str], allowed: frozenset[str]) -> bool:
    return bool(value_types & allowed) or ("integer" in value_types and "number" in allowed)


def _consumed(schema: dict[str, Any]) -> tuple[str, set[str], frozenset[str]]:
    """(outlines-core's branch, the keywords it reads, the JSON types of the values it samples)."""
    branch = next((k for k in _ORDER if k in schema), "")
    if branch == "properties":
        return branch, {"properties", "required", "additionalProperties", "type"}, frozenset({"object"})
    if branch == "prefixItems":
        return branch, {"prefixItems", "items", "minItems", "maxItems", "type"}, frozenset({"array"})
    if branch in ("enum", "const"):
        values = schema[branch] if branch == "enum" and isinstance(schema[branch], list) else [schema[branch]]
        return branch, {branch, "type"}, frozenset().union(*map(_type_of, values)) if values else frozenset()
    if branch != "type":
        return branch, {branch}, _ALL
    types = _types(schema)
    read = {"type"}
    if "string" in types:
        read |= {"minLength", "maxLength"} if {"minLength", "maxLength"} & schema.keys() else set()
        read |= {"pattern"} if read == {"type"} and isinstance(schema.get("pattern"), str) else set()
        read |= {"format"} if read == {"type"} else set()
    read |= {"items", "minItems", "maxItems"} if "array" in types else set()
    read |= {"additionalProperties", "minProperties"} if "object" in types else set()
    return branch, read, types | ({"number"} if "integer" in types else set())


def _check_node(schema: dict[str, Any], where: str) -> tuple[str, set[str], frozenset[str]]:
    """Refuse what outlines-core's branch for this (sub)schema drops or samples against the schema; returns the
    node's `_consumed` (computed once per node: the caller's later checks read it too)."""
    empty = [k for k in _NONEMPTY if schema.get(k) == []]
    if empty:
        _fail(where, f"{empty[0]!r} []", "no value is valid under it; outlines-core samples an empty text")
    bad = sorted(UNENFORCED & schema.keys())
    if "minProperties" in schema and "properties" in schema:
        bad.append("minProperties")
    if bad:
        _fail(
            where, ", ".join(map(repr, bad)), "outlines-core drops it: remove it (a reward can check it) or use a regex"
        )
    branch, read, sampled = _consumed(schema)
    dropped = sorted(k for k in _APPLIES.keys() & schema.keys() if k not in read and _APPLIES[k] & sampled)
    if dropped and branch:  # no branch: outlines-core refuses the schema itself
        reads = ", ".join(map(repr, sorted(read)))
        _fail(where, f"{', '.join(map(repr, dropped))} beside {branch!r}", f"outlines-core reads only {reads} there")
    if "type" in schema and branch != "type" and "type" in read:  # the type is not read: the values must fit it
        allowed = _types(schema)
        if branch in ("enum", "const"):
            values = schema["enum"] if branch == "enum" and isinstance(schema["enum"], list) else [schema[branch]]
            wrong = [v for v in values if not _fits(_type_of(v), allowed)]
        else:
            wrong = [] if _fits(sampled, allowed) else [f"an {next(iter(sampled))}"]
        if wrong:
            _fail(where, f"'type' {schema['type']!r} beside {branch!r}", f"{', '.join(map(str, wrong))} is sampled")
    if branch == "prefixItems" and isinstance(schema["prefixItems"], list):
        n = len(schema["prefixItems"])  # outlines-core samples exactly n items
        if schema.get("minItems", 0) > n or schema.get("maxItems", n) < n:
            _fail(where, f"'minItems'/'maxItems' beside 'prefixItems' of {n}", f"exactly {n} items are sampled")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        n = len(schema["allOf"])
        _fail(where, f"allOf of {n} schemas", "outlines-core concatenates their texts, not JSON: merge them into one")
    props = schema.get("properties")
    if isinstance(props, dict):
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        missing = [n for n in required if n not in props]
        if missing:
            _fail(where, f"required {missing}", "not in its properties, outlines-core drops them: declare them there")
        odd = [n for n in props if any(ord(c) in _UNSAFE_BYTES for c in n)]
        if odd:
            _fail(where, f"property names {odd}", "outlines-core writes '\"', '\\' and control characters unescaped")
    return branch, read, sampled


#: outlines-core's `max_recursion_depth`: a `$ref` met with more than this many references open fails, and
#: `parse_properties` drops the property whose value failed (`continue`), required or not.
_MAX_REF_DEPTH = 3
#: Keywords whose empty list outlines-core turns into the empty regex (a schema no value is valid under).
_NONEMPTY = ("enum", "anyOf", "oneOf", "allOf", "type")
#: Where a keyword's value is a schema, a map of schemas or a list of schemas (what `_group_any` visits).
_SCHEMA_KEYS = ("items", "additionalProperties")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def _group_any(schema: Any) -> None:
    """Replace, in place, every `{}` (any value) below `schema` with `{"anyOf": [{}]}`: outlines-core writes `{}` as
    `(true|false)|(null)|...` unparenthesised, and where it pastes that after a property name or between tuple items
    the '|' binds to the surrounding text; anyOf parenthesises its branches (same language, grouped)."""
    if not isinstance(schema, dict):
        return
    children: list[tuple[Any, Any]] = [(schema, k) for k in _SCHEMA_KEYS]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(schema[key], name) for name in schema[key]]
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(schema[key], i) for i in range(len(schema[key]))]
    for holder, at in children:
        sub = holder.get(at) if isinstance(holder, dict) else holder[at]
        if sub == {}:
            holder[at] = {"anyOf": [{}]}
        else:
            _group_any(sub)


def _ref_target(ref: Any, root: dict[str, Any]) -> tuple[Any, str]:
    """(the schema a local `$ref` names, its place as `$.a.b`); (None, ref) where it does not resolve (outlines-core
    refuses the schema itself then)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None, str(ref)
    node: Any = root
    parts = [p for p in ref[1:].split("/") if p]
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return node, ".".join(["$", *parts])


def _ref_limit(node: Any, depth: int, where: str, root: dict[str, Any], drops: list[str], seen: dict) -> bool:
    """Whether outlines-core's regex of `node`, reached with `depth` references open, fails on the `$ref` depth
    limit (its dispatch, `_ORDER`, replayed); each required property dropped on that failure goes into `drops`."""
    if not isinstance(node, dict) or not node:
        return False
    key = (id(node), depth)
    if key in seen:
        return seen[key]
    seen[key] = False  # a cycle at the same depth cannot occur (every $ref deepens): a placeholder, not an answer
    branch = next((k for k in _ORDER if k in node), "")
    value = node.get(branch)
    fails = False
    if branch == "properties" and isinstance(value, dict):
        required = node.get("required") if isinstance(node.get("required"), list) else []
        for name, sub in value.items():
            if _ref_limit(sub, depth, f"{where}.properties.{name}", root, drops, seen) and name in required:
                drops.append(f"{where}.properties.{name}")
    elif branch in ("allOf", "anyOf", "oneOf", "prefixItems") and isinstance(value, list):
        fails = any(_ref_limit(s, depth, f"{where}.{branch}[{i}]", root, drops, seen) for i, s in enumerate(value))
    elif branch == "$ref":
        target, place = _ref_target(value, root)
        fails = depth > _MAX_REF_DEPTH or _ref_limit(target, depth + 1, place, root, drops, seen)
    elif branch == "type":
        types = _types(node)
        subs = [("items", node.get("items"))] if "array" in types else []
        subs += [("additionalProperties", node.get("additionalProperties"))] if "object" in types else []
        fails = any(_ref_limit(s, depth, f"{where}.{k}", root, drops, seen) for k, s in subs if isinstance(s, dict))
    seen[key] = fails
    return fails


def _walk(schema: Any, where: str, visit: Any) -> None:
    if not isinstance(schema, dict):
        return
    visit(schema, where)
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                _walk(sub, f"{where}.{key}.{name}", visit)
    for key in ("items", "additionalProperties"):
        _walk(schema.get(key), f"{where}.{key}", visit)
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _walk(sub, f"{where}.{key}[{i}]", visit)


def _pattern_core(pattern: str) -> str:
    """`pattern` without a leading '^' and an unescaped trailing '$' (outlines-core matches it whole anyway)."""
    core = pattern[1:] if pattern.startswith("^") else pattern
    if core.endswith("$") and (len(core) - 1 - len(core[:-1].rstrip("\\"))) % 2 == 0:
        core = core[:-1]
    return core


@functools.lru_cache(maxsize=1)
def byte_vocabulary() -> Any:
    """An outlines-core Vocabulary of the 256 single bytes: any text is reachable, so compiling an Index over it
    checks a regex (syntax, DFA) without a tokenizer, as vLLM and SGLang would compile it (milliseconds)."""
    import outlines_core

    return outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def _unsafe_bytes(content_regex: str) -> bool:
    """Whether text matched by `content_regex` can hold '"', '\\' or a control character (not JSON unescaped)."""
    import outlines_core

    try:
        index = outlines_core.Index(content_regex, byte_vocabulary())
    except Exception:  # the whole schema's compile reports it, naming the dialect
        return False
    return any(b in _UNSAFE_BYTES for moves in index.get_transitions().values() for b in moves)


@functools.lru_cache(maxsize=64)
def _format_unsafe(fmt: str) -> bool:
    from outlines_core.json_schema import build_regex_from_schema

    try:
        regex = build_regex_from_schema(json.dumps({"type": "string", "format": fmt}))
    except Exception:  # an unsupported format: the whole schema's compile reports it
        return False
    return _unsafe_bytes(regex[1:-1])


def _exclusive(a: Any, b: Any, root: dict[str, Any]) -> bool:
    """Whether no value can be valid under both schemas, shown cheaply: their types are disjoint, or a property both
    require has disjoint const/enum values there (a discriminator). False where not shown."""
    a, b = _resolve(a, root), _resolve(b, root)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    if not _accepted_types(a) & _accepted_types(b):  # integral numbers count as both integer and number
        return True
    req = set(a.get("required", []) if isinstance(a.get("required"), list) else [])
    req &= set(b.get("required", []) if isinstance(b.get("required"), list) else [])
    for name in req:
        va = _values(_resolve((a.get("properties") or {}).get(name), root))
        vb = _values(_resolve((b.get("properties") or {}).get(name), root))
        if va is not None and vb is not None and not va & vb:
            return True
    return False


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    for _ in range(8):  # a chain of local references (a cycle gives up: not shown exclusive)
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#")):
            return schema
        node: Any = root
        for part in filter(None, schema["$ref"][1:].split("/")):
            node = node.get(part) if isinstance(node, dict) else None
        schema = node
    return None


def _accepted_types(schema: dict[str, Any]) -> frozenset[str]:
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return frozenset().union(*map(_type_of, values)) if values else frozenset()
    types = _types(schema)
    return types | ({"integer"} if "number" in types else frozenset())


def _values(schema: Any) -> frozenset[tuple[str, Any]] | None:
    """The const/enum values a schema accepts, comparable as JSON values (1 == 1.0, true != 1); None: any."""
    if not isinstance(schema, dict):
        return None
    raw = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(raw, list):
        return None
    out = set()
    for v in raw:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            out.add((type(v).__name__, v))
        elif isinstance(v, (int, float)):
            out.add(("number", v))
        else:
            out.add(("json", json.dumps(v, sort_keys=True)))
    return frozenset(out)


def check_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema outlines-core is given: refused (ValueError naming the keyword and where it stands) where its
    regex would sample values the schema forbids or text that is not JSON; else a copy whose string patterns are
    grouped (`"a|b"` is sampled as "a" or "b", not '"a' or 'b"')."""
    schema = copy.deepcopy(schema)
    _group_any(schema)
    drops: list[str] = []
    _ref_limit(schema, 0, "$", schema, drops, {})
    if drops:
        _fail(
            drops[0],
            "a required property holding a recursive '$ref'",
            f"outlines-core expands a recursion {_MAX_REF_DEPTH} levels deep, then drops the property, leaving "
            "objects without it and a trailing comma (not JSON): make it optional, or write the levels out",
        )

    def visit(node: dict[str, Any], where: str) -> None:
        # Once per node (the pattern rewrite below leaves it a string: what is read does not change).
        branch, read, _ = _check_node(node, where)
        pattern = node.get("pattern")
        if isinstance(pattern, str) and "string" in _types(node) and "pattern" in read:
            core = _pattern_core(pattern)
            if _unsafe_bytes(core):
                _fail(
                    f"{where}.pattern",
                    f"pattern {pattern!r}",
                    "it can match '\"', '\\' or a control character, which outlines-core writes into the JSON string "
                    "unescaped: exclude them, e.g. [^\"\\\\\\x00-\\x1f] for '.'",
                )
            node["pattern"] = f"^(?:{core})$"  # outlines-core strips '^...$' and puts the rest between quotes
        fmt = node.get("format")
        if isinstance(fmt, str) and "format" in read and _format_unsafe(fmt):
            _fail(f"{where}.format", f"format {fmt!r}", "outlines-core's regex for it writes text that is not JSON")
        branches = node.get("oneOf")
        if isinstance(branches, list) and branch == "oneOf":
            for i in range(len(branches)):
                for j in range(i + 1, len(branches)):
                    if not _exclusive(branches[i], branches[j], schema):
                        _fail(
                            where,
                            f"oneOf branches {i} and {j}",
                            "outlines-core samples oneOf as anyOf, and these are not shown exclusive: use anyOf, or "
                            "give the branches distinct types or a required property with distinct const values",
                        )

    _walk(schema, "$", visit)
    return schema
