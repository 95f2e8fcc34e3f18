"""JSON-schema shapes outlines-core's regex builder turns into a language other than the schema's, without a word
(roll_engines._structured_schema): an any-value `{}` below the root (its alternation left ungrouped), an empty
`enum` / `anyOf` / `oneOf` / `allOf` / `type` list (the empty regex), a required property holding a recursive `$ref`
(dropped at outlines-core's depth limit, leaving a trailing comma). Each is grouped or refused by `to_regex`."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from roll_core.interfaces.inference import StructuredOutput

pytest.importorskip("outlines_core")


def _outlines(schema: dict[str, Any]) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    return build_regex_from_schema(json.dumps(schema))


def _valid(schema: dict[str, Any], text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):  # an empty anyOf: no schema at all
        return False
    return True


ANY = {"$defs": {"Any": {}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/Any"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "schema, texts",
    [
        ({"type": "object", "properties": {"a": {}}, "required": ["a"]}, ['{"a":null}', "null", '{"a":true', "1"]),
        (ANY, ['{"a":"x"}', '{"a":{"b":1}}', "[1]", '{"a":false']),
        ({"type": "array", "prefixItems": [{}, {"type": "integer"}]}, ["[null,1]", '["x",2]', "null", "[1,[],1]"]),
        ({"anyOf": [{"type": "integer"}, {"type": "array", "prefixItems": [{}]}]}, ["1", "[true]", "[true", "null"]),
    ],
)
def test_any_value_subschemas_sample_the_schemas_language(schema: dict[str, Any], texts: list[str]) -> None:
    """outlines-core writes `{}` as `(true|false)|(null)|...` and pastes it after a property name or between tuple
    items unparenthesised: the '|' bound to the text around it, so `{"properties": {"a": {}}}` sampled `null`, `1`
    or `{"a":true` (no closing brace). Below the root `{}` is now sent grouped: the regex accepts exactly the
    valid texts among these. (The regex is built as to_regex builds it, not compiled to a DFA: an any-value
    regex takes outlines-core tens of seconds to compile on a loaded CPU.)"""
    from roll_engines._structured_schema import check_schema

    bad = [t for t in texts if not _valid(schema, t)]
    assert bad and any(re.fullmatch(_outlines(schema), t) for t in bad)  # why: outlines-core's own regex
    regex = _outlines(check_schema(schema))
    assert [t for t in texts if re.fullmatch(regex, t)] == [t for t in texts if _valid(schema, t)]


@pytest.mark.parametrize(
    "schema, forbidden, match",
    [
        ({"enum": []}, "", r"'enum' \[\] at \$ "),
        ({"anyOf": []}, "", r"'anyOf' \[\] at \$ "),
        ({"type": []}, "", r"'type' \[\] at \$ "),
        ({"properties": {"a": {"oneOf": []}}, "required": ["a"]}, '{"a":}', r"'oneOf' \[\] at \$\.properties\.a "),
        ({"type": "array", "items": {"allOf": []}, "minItems": 1}, "[,]", r"'allOf' \[\] at \$\.items "),
    ],
)
def test_an_empty_list_no_value_is_valid_under_is_refused(schema: dict[str, Any], forbidden: str, match: str) -> None:
    """An empty enum / anyOf / oneOf / allOf / type list admits no value; outlines-core made it the empty regex, so
    the sampler wrote an empty response (or `{"a":}`). Refused, naming the keyword and its place."""
    from roll_engines.structured import to_regex

    assert re.fullmatch(_outlines(schema), forbidden) and not _valid(schema, forbidden or "0")
    with pytest.raises(ValueError, match=f"StructuredOutput.json_schema: {match}.*no value is valid"):
        to_regex(StructuredOutput(json_schema=schema))


TREE = {
    "$defs": {
        "T": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}},
            "required": ["v", "kids"],
        }
    },
    "$ref": "#/$defs/T",
}


def _tree(depth: int) -> str:
    return '{"v":1,"kids":[]}' if depth == 0 else f'{{"v":1,"kids":[{_tree(depth - 1)}]}}'


def test_a_required_property_holding_a_recursive_ref_is_refused() -> None:
    """outlines-core expands a recursive $ref 3 levels deep, then drops the property that holds it: a required one
    left `{"v":1,}` (not JSON, the required 'kids' missing) in the language at the fourth level. Refused naming the
    property; recursion through an optional property (dropped at the limit: a smaller language, still the
    schema's) compiles."""
    from roll_engines.structured import to_regex

    cut = '{"v":1,"kids":[{"v":1,"kids":[{"v":1,"kids":[{"v":1,}]}]}]}'
    assert re.fullmatch(_outlines(TREE), cut) and not _valid(TREE, cut.replace(",}", "}"))
    with pytest.raises(ValueError, match=r"recursive '\$ref' at \$\.\$defs\.T\.properties\.kids .*trailing comma"):
        to_regex(StructuredOutput(json_schema=TREE))
    # Through an anyOf and a list of required properties deeper down: the same drop, refused too.
    deep = {
        "type": "object",
        "properties": {"x": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}, "y": {"type": "integer"}},
        "required": ["x", "y"],
    }
    with pytest.raises(ValueError, match=r"at \$\.properties\.x "):
        to_regex(StructuredOutput(json_schema=deep))
    optional = json.loads(json.dumps(TREE))
    optional["$defs"]["T"]["required"] = ["v"]
    regex = to_regex(StructuredOutput(json_schema=optional))
    for depth in range(3):
        assert re.fullmatch(regex, _tree(depth)) and _valid(optional, _tree(depth))
    assert not any(re.fullmatch(regex, t) for t in ('{"v":1,}', cut))
