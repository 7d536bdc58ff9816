"""schema_to_regex and friends: random walks through the compiled DFAs produce JSON that
satisfies the schema; valid documents are accepted (compact and pretty-printed), invalid
ones rejected; unsupported keywords are refused by name."""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import random
import re
import uuid

import pytest

from spindle.structured.json_schema import (DEFAULT_WHITESPACE, any_json_object_regex,
                                            any_json_regex, choice_regex, regex_escape,
                                            schema_to_regex)
from spindle.structured.regex_dfa import compile_regex
from test_structured_regex import distances_to_accept, random_walk


def format_ok(text: str, name: str) -> bool:
    """Shape checks: a date's day is not checked against its month's length."""
    if name == "date":
        match = re.fullmatch(r"\d{4}-(\d{2})-(\d{2})", text)
        return bool(match) and 1 <= int(match[1]) <= 12 and 1 <= int(match[2]) <= 31
    if name == "time":
        return bool(re.fullmatch(r"\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})", text)) \
            and datetime.time.fromisoformat(text) is not None
    if name == "date-time":
        day, _, time = text.partition("T")
        return format_ok(day, "date") and format_ok(time, "time")
    if name == "uuid":
        return bool(re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", text)) \
            and uuid.UUID(text) is not None
    if name == "ipv4":
        try:
            return str(ipaddress.IPv4Address(text)) == text
        except ValueError:
            return False
    return name == "email" and text.count("@") == 1


def has_type(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "null": type(None),
                              "object": dict, "array": list}[name])


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True)


def satisfies(value, schema, root=None, depth: int = 0) -> bool:
    """A small validator for the keywords these tests use."""
    root = schema if root is None else root
    if schema is True:
        return True
    if "$ref" in schema:
        ref = schema["$ref"]
        target = root if ref == "#" else root[ref.split("/")[1]][ref.split("/")[2]]
        return satisfies(value, target, root, depth + 1)
    if "anyOf" in schema and not any(satisfies(value, s, root) for s in schema["anyOf"]):
        return False
    if "enum" in schema and canonical(value) not in map(canonical, schema["enum"]):
        return False
    if "const" in schema and canonical(value) != canonical(schema["const"]):
        return False
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(has_type(value, t) for t in types):
            return False
    if isinstance(value, str):
        return string_ok(value, schema)
    if isinstance(value, list):
        return array_ok(value, schema, root)
    if isinstance(value, dict):
        return object_ok(value, schema, root)
    return True


def string_ok(value: str, schema: dict) -> bool:
    if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        return False
    if "pattern" in schema and not re.search(schema["pattern"], value):
        return False
    return "format" not in schema or format_ok(value, schema["format"])


def array_ok(value: list, schema: dict, root) -> bool:
    if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
        return False
    prefix = schema.get("prefixItems", [])
    if schema.get("items") is False and len(value) > len(prefix):
        return False
    schemas = prefix + [schema.get("items", True)] * (len(value) - len(prefix))
    return all(satisfies(item, s, root) for item, s in zip(value, schemas))


def object_ok(value: dict, schema: dict, root) -> bool:
    properties = schema.get("properties", {})
    if any(name not in value for name in schema.get("required", [])):
        return False
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        subschema = properties.get(key, extra)
        if subschema is False or not satisfies(item, subschema, root):
            return False
    return True


PERSON = {
    "title": "Person", "description": "a person", "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "description": "years"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age"], "additionalProperties": False,
}
OPTIONAL_POSITIONS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                   "c": {"type": "boolean"}, "d": {"type": "null"}, "e": {"type": "number"}},
    "required": ["b", "d"],
}
ALL_OPTIONAL = {"type": "object", "properties": {
    "x": {"type": "integer"}, "y": {"type": "boolean"}, "z": {"type": "string"}}}
POINT_DEFS = {
    "$defs": {"point": {"type": "object", "required": ["x", "y"],
                        "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
    "type": "object", "required": ["a"],
    "properties": {"a": {"$ref": "#/$defs/point"},
                   "b": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2}},
}
TREE = {
    "$defs": {"node": {"type": "object", "required": ["value"], "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
    "$ref": "#/$defs/node",
}
FORMATS = {
    "type": "object", "required": ["day", "at", "stamp", "id", "ip"],
    "properties": {"day": {"type": "string", "format": "date"},
                   "at": {"type": "string", "format": "time"},
                   "stamp": {"type": "string", "format": "date-time"},
                   "id": {"type": "string", "format": "uuid"},
                   "ip": {"type": "string", "format": "ipv4"}},
}
NESTED = {
    "type": "object", "required": ["meta"], "properties": {"meta": {
        "type": "object", "required": ["version", "owner"], "properties": {
            "version": {"const": 2},
            "owner": {"type": "object", "required": ["id"],
                      "properties": {"id": {"type": ["integer", "null"]}}}}}},
}
GOOD_FORMATS = {"day": "2024-02-29", "at": "12:30:00Z", "stamp": "2024-02-29T23:59:59.5+01:00",
                "id": str(uuid.UUID(int=5)), "ip": "192.168.0.1"}

# (name, schema, valid documents, invalid documents)
CASES = [
    ("person", PERSON,
     [{"name": "Ann", "age": 30}, {"name": "Zoë", "age": 0, "tags": []},
      {"name": "Bob", "age": -1, "email": "bob@example.com", "tags": ["a", "b"]}],
     [{"age": 30}, {"name": "Ann", "age": "30"}, {"name": "Ann", "age": 30, "extra": 1},
      {"name": "", "age": 1}, {"name": "Ann", "age": 1, "tags": ["a", "b", "c", "d"]},
      {"name": "Ann", "age": 1.5}, [], "Ann"]),
    ("optional_positions", OPTIONAL_POSITIONS,
     [{"b": "", "d": None}, {"a": 1, "b": "x", "c": True, "d": None, "e": 1.5}],
     [{"b": "x"}, {"a": 1, "d": None}, {"b": "x", "d": None, "f": 1}]),
    ("all_optional", ALL_OPTIONAL, [{}, {"y": False}, {"x": 1, "z": "q"}],
     [{"x": "1"}, {"w": 1}, None]),
    ("array_bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                      "maxItems": 4},
     [[1, 2], [1, 2, 3, 4]], [[1], [1, 2, 3, 4, 5], [1, "2"], {}]),
    ("mixed_enum", {"enum": ["red", 1, 2.5, None, True, {"k": [1, 2]}, ["x"], "é"]},
     ["red", 1, 2.5, None, True, {"k": [1, 2]}, ["x"], "é"], ["blue", 2, False, {"k": []}]),
    ("any_of", {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"},
                          {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                          {"type": "null"}]},
     ["abc", 5, [True, False], None], ["abcd", 1.5, [True, True, True], {}]),
    ("point_defs", POINT_DEFS,
     [{"a": {"x": 1, "y": 2.5}}, {"a": {"x": 0, "y": 0}, "b": [{"x": 1, "y": 1}]}],
     [{"b": []}, {"a": {"x": 1}}, {"a": {"x": 1, "y": 2}, "b": [{"x": 1, "y": 1}] * 3}]),
    ("tree", TREE,
     [{"value": 1}, {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]},
      {"value": 1, "children": [{"value": 2, "children": [{"value": 3, "children": []}]}]}],
     [{"value": 1, "children": [{"value": 2, "children": [
         {"value": 3, "children": [{"value": 4}]}]}]}, {"children": []}]),
    ("formats", FORMATS, [GOOD_FORMATS],
     [{**GOOD_FORMATS, "day": "2024-13-01"}, {**GOOD_FORMATS, "ip": "256.1.1.1"},
      {**GOOD_FORMATS, "id": "xyz"}, {**GOOD_FORMATS, "at": "25:00:00Z"}]),
    ("lengths", {"type": "string", "minLength": 2, "maxLength": 5},
     ["ab", "abcde", "éé", "a\n", 'a"'], ["a", "abcdef", 5]),
    ("tuple", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}],
               "items": False, "minItems": 1},
     [["a"], ["a", 1.5]], [[], [1], ["a", 1, 2], ["a", "b"]]),
    ("nested", NESTED,
     [{"meta": {"version": 2, "owner": {"id": None}}},
      {"meta": {"version": 2, "owner": {"id": 7}}}],
     [{"meta": {"version": 3, "owner": {"id": 1}}}, {"meta": {"version": 2, "owner": {}}},
      {"meta": {"version": 2, "owner": {"id": "x"}}}]),
    ("map", {"type": "object", "additionalProperties": {"type": "integer"}},
     [{}, {"a": 1, "b c": 2, "é": 3}], [{"a": "x"}, []]),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
     ["AB-123"], ["AB-12", "ab-123", "AB-1234"]),
    ("any_depth_2", {}, [{"a": [1, 2]}, "x", 1.5, None, [{"k": "v"}]], [[[[1]]], {"a": [[]]}]),
]
DEPTH = {"any_depth_2": 2}


@pytest.fixture(scope="module")
def dfas():
    return {name: compile_regex(schema_to_regex(schema, max_depth=DEPTH.get(name, 3)))
            for name, schema, _, _ in CASES}


def renderings(document) -> list[str]:
    """Compact, default-spaced, pretty-printed (where the indentation stays within the
    whitespace bound of 20) and non-ASCII renderings."""
    texts = [json.dumps(document), json.dumps(document, separators=(",", ":")),
             json.dumps(document, ensure_ascii=False)]
    for indent in (2, 4):
        text = json.dumps(document, indent=indent)
        if max(len(line) - len(line.lstrip(" ")) for line in text.splitlines()) < 20:
            texts.append(text)
    return texts


@pytest.mark.parametrize("name,schema,valid,invalid", CASES, ids=[c[0] for c in CASES])
def test_documents(dfas, name, schema, valid, invalid):
    dfa = dfas[name]
    for document in valid:
        assert satisfies(document, schema), document  # the test's own validator agrees
        for text in renderings(document):
            assert dfa.fullmatch(text), (name, text)
    for document in invalid:
        for text in renderings(document):
            assert not dfa.fullmatch(text), (name, text)


@pytest.mark.parametrize("name,schema", [c[:2] for c in CASES], ids=[c[0] for c in CASES])
def test_random_walks_satisfy_schema(dfas, name, schema):
    dfa = dfas[name]
    rng, distance = random.Random(name), distances_to_accept(dfa)
    for _ in range(20):
        text = random_walk(dfa, rng, distance, soft_limit=150).decode("utf-8")
        document = json.loads(text)
        assert satisfies(document, schema), (name, text)
        if name == "any_depth_2":
            assert nesting(document) <= 2, text


def test_random_walks_satisfy_jsonschema_package(dfas):
    jsonschema = pytest.importorskip("jsonschema")
    for name, schema, _, _ in CASES:
        dfa = dfas[name]
        rng, distance = random.Random(name + "!"), distances_to_accept(dfa)
        for _ in range(10):
            text = random_walk(dfa, rng, distance, soft_limit=150).decode("utf-8")
            jsonschema.validate(json.loads(text), schema)


def test_every_combination_of_optional_properties():
    dfa = compile_regex(schema_to_regex(OPTIONAL_POSITIONS))
    values = {"a": 1, "b": "x", "c": True, "d": None, "e": 2.5}
    for present in itertools.product([False, True], repeat=3):
        optional = {k for k, on in zip("ace", present) if on}
        document = {k: v for k, v in values.items() if k in optional or k in "bd"}
        for text in renderings(document):
            assert dfa.fullmatch(text), text
        compact = json.dumps(document)
        assert not dfa.fullmatch(compact[:-1] + ", }")  # trailing comma
        assert not dfa.fullmatch("{, " + compact[1:])  # leading comma
        assert not dfa.fullmatch(compact.replace(", ", ", , ", 1))
    assert not dfa.fullmatch('{"d": null, "b": "x"}')  # properties come in schema order


def nesting(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


def test_any_json_object():
    dfa = compile_regex(any_json_object_regex(3))
    for document in [{}, {"a": 1}, {"a": {"b": [1, "x", None, True, -2.5e3]}},
                     {"é": "ü", "k": [], "m": {}}]:
        for text in renderings(document):
            assert dfa.fullmatch(text), text
    for text in ['{"a": {"b": [[1]]}}', "[]", "1", '"x"', '{"a" 1}', "{'a': 1}", " {}",
                 "{} ", '{"a": 1,}', '{"a": tru}']:
        assert not dfa.fullmatch(text), text
    rng, distance = random.Random(3), distances_to_accept(dfa)
    for _ in range(30):
        document = json.loads(random_walk(dfa, rng, distance, soft_limit=120).decode())
        assert isinstance(document, dict) and nesting(document) <= 3
    with pytest.raises(ValueError, match="max_depth"):
        any_json_object_regex(0)


def test_any_json_depth_zero_is_scalars():
    dfa = compile_regex(any_json_regex(0))
    assert dfa.fullmatch("1") and dfa.fullmatch('"a"') and dfa.fullmatch("null")
    assert not dfa.fullmatch("[]") and not dfa.fullmatch("{}")


def test_whitespace_bound():
    dfa = compile_regex(schema_to_regex(ALL_OPTIONAL))
    assert DEFAULT_WHITESPACE == r"[ \n\t]{0,20}"
    assert dfa.fullmatch("{" + " " * 20 + "}") and not dfa.fullmatch("{" + " " * 21 + "}")
    assert dfa.fullmatch('{\n\t"x":\t1\n}')
    assert not dfa.fullmatch(' {"x": 1}') and not dfa.fullmatch('{"x": 1}\n')
    compact = compile_regex(schema_to_regex(ALL_OPTIONAL, whitespace=""))
    assert compact.fullmatch('{"x":1,"y":true}') and not compact.fullmatch('{"x": 1}')
    with pytest.raises(ValueError, match="JSON whitespace"):
        schema_to_regex(ALL_OPTIONAL, whitespace="[ a]*")


def test_choices_and_escaping():
    choices = ["yes", "no", "maybe?", "a|b", "(x)", "é", "[1-2]", "", "tab\there"]
    dfa = compile_regex(choice_regex(choices))
    for choice in choices:
        assert dfa.fullmatch(choice), choice
    for other in ["y", "yesno", "a", "1", "maybe", "x"]:
        assert not dfa.fullmatch(other), other
    rng = random.Random(7)
    for _ in range(200):
        text = "".join(rng.choice("\\.^$*+?{}[]()|-&~# ab\n\x00é") for _ in range(6))
        assert re.fullmatch(regex_escape(text), text)
        assert compile_regex(regex_escape(text)).fullmatch(text), text
    for bad in ([], ["a", 1], "ab", None):
        with pytest.raises(ValueError, match="choices"):
            choice_regex(bad)


RECURSIVE_REQUIRED = {"$defs": {"n": {"type": "object", "required": ["next"], "properties": {
    "next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
SCHEMA_ERRORS = [
    ({"type": "integer", "minimum": 0}, "minimum"),
    ({"type": "number", "exclusiveMaximum": 3}, "exclusiveMaximum"),
    ({"type": "number", "multipleOf": 2}, "multipleOf"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {}}, "contains"),
    ({"type": "object", "patternProperties": {}}, "patternProperties"),
    ({"type": "object", "propertyNames": {}}, "propertyNames"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "dependentRequired": {}}, "dependentRequired"),
    ({"not": {}}, "not"),
    ({"if": {}, "then": {}}, "if"),
    ({"type": "string", "foo": 1}, "foo"),
    ({"type": "string", "format": "uri"}, "uri"),
    (False, "false"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "false"),
    ({"allOf": [{}, {}]}, "allOf"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True},
     "additionalProperties"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ({"$ref": "http://example.com/schema.json"}, "unsupported $ref"),
    ({"$ref": "#/$defs/missing"}, "no such definition"),
    (RECURSIVE_REQUIRED, "recursive $ref '#/$defs/n'"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ({"type": "string", "pattern": "a", "maxLength": 3}, "together"),
    ({"type": "bogus"}, "bogus"),
    ({"enum": []}, "enum"),
    ({"enum": ["a"], "minLength": 1}, "minLength"),
    ({"type": "integer", "enum": ["a"]}, "type"),
    ({"$ref": "#/$defs/x", "type": "string", "$defs": {"x": {}}}, "'$ref' combined"),
    ({"type": "array", "minItems": -1}, "minItems"),
    ("not a schema", "must be an object"),
]


@pytest.mark.parametrize("schema,keyword", SCHEMA_ERRORS, ids=[k for _, k in SCHEMA_ERRORS])
def test_unsupported_schemas_are_refused_by_name(schema, keyword):
    with pytest.raises(ValueError, match=re.escape(keyword)):
        schema_to_regex(schema)


def test_recursive_optional_branch_is_dropped_at_max_depth():
    linked = {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer"}}}
    dfa = compile_regex(schema_to_regex(linked, max_depth=2))
    assert dfa.fullmatch('{"next": {"next": {"v": 1}}}')
    assert not dfa.fullmatch('{"next": {"next": {"next": {}}}}')


def test_enum_values_written_both_ways_and_type_filtered():
    dfa = compile_regex(schema_to_regex({"type": "string", "enum": ["é", 1, "x\"y"]}))
    assert dfa.fullmatch('"é"') and dfa.fullmatch('"\\u00e9"') and dfa.fullmatch('"x\\"y"')
    assert not dfa.fullmatch("1")
