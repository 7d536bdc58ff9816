"""JSON schemas, "any JSON" and choice lists turned into regexes for compile_regex.

The regexes describe JSON text (json.loads parses every match) that satisfies the schema.
A regex cannot count, compare numbers or intersect languages, so keywords that need that
(minimum, multipleOf, uniqueItems, patternProperties, not, ...) are refused with a
ValueError naming them rather than silently ignored. Known departures from JSON Schema:

- `oneOf` is treated as `anyOf`: the exclusivity of its branches is not enforced.
- `pattern` must match the whole string content (JSON Schema searches for it anywhere),
  and the characters JSON must escape (`"`, backslash, U+0000-U+001F) are never allowed in
  a patterned string, even escaped: they are removed from every character set of the
  pattern, so the regex stays inside the string.
- `minLength`/`maxLength` count JSON string units: a character or an escape sequence
  (a surrogate pair written as two \\u escapes counts 2).
- Object properties come in the order of `properties` (and of the keys of enum/const
  objects); keys and scalar enum/const values are written as json.dumps writes them, with
  or without ensure_ascii.
- Recursive `$ref`s are expanded max_depth times; deeper, the recursive branch is not
  offered. Unconstrained values ({} or true) are any JSON value nesting at most max_depth
  containers deep.
"""

from __future__ import annotations

import json

from spindle.structured.regex_dfa import parse_regex, restrict_regex

# Whitespace between tokens: a newline and indentation for pretty-printed JSON, or a space
# or two for compact JSON. Bounded, so a model cannot loop on whitespace; every use costs
# about 20 DFA states, so much longer bounds make schema DFAs markedly bigger.
DEFAULT_WHITESPACE = r"[ \n\t]{0,20}"
DEFAULT_MAX_DEPTH = 3
# $refs used several times at several levels multiply the regex; past this, refuse.
MAX_REGEX_CHARS = 2_000_000

STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"
JSON_WHITESPACE = frozenset(" \t\n\r")
# What JSON strings must escape: never allowed inside a `pattern`.
MUST_ESCAPE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))

_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
         r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HEX = "[0-9a-fA-F]"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": rf"[A-Za-z0-9_%+-]+(?:\.[A-Za-z0-9_%+-]+)*@{_LABEL}(?:\.{_LABEL})+",
    "ipv4": rf"(?:{_OCTET}\.){{3}}{_OCTET}",
}

# Keywords that do not constrain the text. "discriminator" (OpenAPI, emitted by pydantic)
# only names the property that tells oneOf's branches apart.
ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "discriminator"})
TYPE_KEYWORDS = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "array": frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems",
                        "uniqueItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
}
SUPPORTED = ANNOTATIONS | {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"} \
    | frozenset().union(*TYPE_KEYWORDS.values())
JSON_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
METACHARACTERS = frozenset("\\.^$*+?{}[]()|-&~# ")


def regex_escape(text: str) -> str:
    """text as a regex matching exactly it (metacharacters and control characters escaped)."""
    if not isinstance(text, str):
        raise ValueError(f"regex_escape takes a str, got {type(text).__name__}")
    parts = []
    for char in text:
        if char in METACHARACTERS:
            parts.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            parts.append(f"\\x{ord(char):02x}")
        else:
            parts.append(char)
    return "".join(parts)


def alternation(regexes) -> str:
    unique = list(dict.fromkeys(regexes))
    return unique[0] if len(unique) == 1 else "(?:" + "|".join(unique) + ")"


def repeat(lo: int, hi: int | None) -> str:
    if hi is None:
        return "*" if lo == 0 else f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of the strings."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("choices must be a non-empty list of strings")
    for choice in choices:
        if not isinstance(choice, str):
            raise ValueError(f"choices must be strings, got {type(choice).__name__}: "
                             f"{choice!r}")
    return "(?:" + "|".join(regex_escape(choice) for choice in choices) + ")"


def json_literal(value, where: str) -> str:
    """The regex of value as json.dumps writes it, with ASCII escapes or without."""
    try:
        forms = [json.dumps(value, allow_nan=False),
                 json.dumps(value, allow_nan=False, ensure_ascii=False)]
    except (TypeError, ValueError) as error:
        raise ValueError(f"{value!r} at {where} is not a JSON value: {error}") from None
    return alternation(regex_escape(form) for form in forms)


def has_json_type(value, json_type: str) -> bool:
    if json_type == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    expected = {"string": str, "boolean": bool, "null": type(None), "object": dict,
                "array": list}[json_type]
    return isinstance(value, expected)


def check_whitespace(whitespace: str) -> None:
    """The whitespace regex must parse and match nothing but JSON whitespace."""
    allowed = {ord(char) for char in JSON_WHITESPACE}
    stack = [parse_regex(whitespace)]
    while stack:
        node = stack.pop()
        if node[0] == "set":
            if not all(hi - lo < len(allowed) and set(range(lo, hi + 1)) <= allowed
                       for lo, hi in node[1]):
                raise ValueError(f"whitespace regex {whitespace!r} matches characters other "
                                 "than JSON whitespace (space, \\t, \\n, \\r)")
        elif node[0] == "rep":
            stack.append(node[1])
        else:
            stack.extend(node[1])


class _Unavailable(ValueError):
    """A recursive $ref nested deeper than max_depth: the enclosing alternatives, optional
    properties or array items drop the branch; with nothing left to drop, it is an error."""


def check_count(schema: dict, key: str, where: str) -> int | None:
    value = schema.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 0):
        raise ValueError(f"{key} at {where} must be a non-negative integer, got {value!r}")
    return value


class _SchemaCompiler:
    def __init__(self, root, whitespace: str, max_depth: int):
        self.root = root
        self.ws = f"(?:{whitespace})"
        self.sep = f"{self.ws},{self.ws}"
        self.max_depth = max_depth
        self.ref_stack: list[str] = []
        self.any_cache: dict[int, str] = {}

    # --- any JSON value ---

    def any_value(self, depth: int) -> str:
        if depth not in self.any_cache:
            options = [STRING, NUMBER, BOOLEAN, NULL]
            if depth > 0:
                inner = self.any_value(depth - 1)
                options += [self.any_object(inner), self.any_array(inner)]
            self.any_cache[depth] = alternation(options)
        return self.any_cache[depth]

    def any_object(self, value: str) -> str:
        member = f"{STRING}{self.ws}:{self.ws}{value}"
        return rf"\{{{self.ws}(?:{member}(?:{self.sep}{member})*{self.ws})?\}}"

    def any_array(self, value: str) -> str:
        return rf"\[{self.ws}(?:{value}(?:{self.sep}{value})*{self.ws})?\]"

    # --- schemas ---

    def value(self, schema, where: str) -> str:
        if schema is True:
            return self.any_value(self.max_depth)
        if schema is False:
            raise ValueError(f"schema at {where} is false: no value satisfies it")
        if not isinstance(schema, dict):
            raise ValueError(f"schema at {where} must be an object or a boolean, got "
                             f"{type(schema).__name__}")
        for key in schema:
            if key not in SUPPORTED:
                raise ValueError(f"unsupported JSON schema keyword {key!r} at {where}")
        if "$ref" in schema:
            self.only_annotations_beside("$ref", schema, where)
            return self.reference(schema["$ref"], where)
        if "allOf" in schema:
            return self.all_of(schema, where)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                self.only_annotations_beside(key, schema, where)
                branches = self.subschemas(schema, key, where)
                return self.first_available(
                    [lambda s=s, i=i: self.value(s, f"{where}/{key}/{i}")
                     for i, s in enumerate(branches)])
        if "enum" in schema or "const" in schema:
            return self.enumeration(schema, where)
        types = self.types(schema, where)
        if types is None:
            return self.any_value(self.max_depth)
        return self.first_available([lambda t=t: self.typed(schema, t, where) for t in types])

    def only_annotations_beside(self, key: str, schema: dict, where: str) -> None:
        others = sorted(set(schema) - ANNOTATIONS - {key})
        if others:
            raise ValueError(f"{key!r} combined with {others} at {where} is not supported")

    def subschemas(self, schema: dict, key: str, where: str) -> list:
        branches = schema[key]
        if not isinstance(branches, list) or not branches:
            raise ValueError(f"{key} at {where} must be a non-empty list of schemas")
        return branches

    def all_of(self, schema: dict, where: str) -> str:
        self.only_annotations_beside("allOf", schema, where)
        branches = self.subschemas(schema, "allOf", where)
        if len(branches) != 1:
            raise ValueError(f"allOf at {where} has {len(branches)} schemas; only one is "
                             "supported")
        return self.value(branches[0], f"{where}/allOf/0")

    def first_available(self, builders) -> str:
        """The alternation of the builders' regexes, leaving out recursion cut short."""
        regexes, cut = [], None
        for build in builders:
            try:
                regexes.append(build())
            except _Unavailable as error:
                cut = cut or error
        if not regexes:
            raise cut
        return alternation(regexes)

    def reference(self, ref, where: str) -> str:
        if not isinstance(ref, str):
            raise ValueError(f"$ref at {where} must be a string")
        target = self.resolve(ref, where)
        if self.ref_stack.count(ref) >= self.max_depth:
            raise _Unavailable(f"recursive $ref {ref!r} at {where} nests deeper than "
                               f"max_depth={self.max_depth} and has no alternative there")
        self.ref_stack.append(ref)
        try:
            regex = self.value(target, ref)
        finally:
            self.ref_stack.pop()
        if len(regex) > MAX_REGEX_CHARS:
            raise ValueError(f"schema too large: $ref {ref!r} at {where} expands to more than "
                             f"{MAX_REGEX_CHARS} regex characters")
        return regex

    def resolve(self, ref: str, where: str):
        if ref == "#":
            return self.root
        for section in ("$defs", "definitions"):
            prefix = f"#/{section}/"
            if ref.startswith(prefix) and isinstance(self.root, dict):
                name = ref[len(prefix):].replace("~1", "/").replace("~0", "~")
                definitions = self.root.get(section)
                if not isinstance(definitions, dict) or name not in definitions:
                    raise ValueError(f"$ref {ref!r} at {where}: no such definition")
                return definitions[name]
        raise ValueError(f"unsupported $ref {ref!r} at {where}: only '#', "
                         "'#/$defs/NAME' and '#/definitions/NAME' are supported")

    def enumeration(self, schema: dict, where: str) -> str:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"enum at {where} must be a non-empty list")
        others = sorted(set(schema) - ANNOTATIONS - {"enum", "const", "type"})
        if others or ("enum" in schema and "const" in schema):
            raise ValueError(f"enum/const combined with {others or ['enum']} at {where} is "
                             "not supported")
        types = self.types(schema, where) if "type" in schema else JSON_TYPES
        allowed = [v for v in values if any(has_json_type(v, t) for t in types)]
        if not allowed:
            raise ValueError(f"no enum/const value at {where} has the type {types}")
        return alternation(self.literal(v, where) for v in allowed)

    def literal(self, value, where: str) -> str:
        """value's regex; containers take whitespace between their tokens like the rest."""
        if isinstance(value, dict):
            members = [f"{json_literal(key, where)}{self.ws}:{self.ws}"
                       f"{self.literal(item, where)}" for key, item in value.items()]
            return rf"\{{{self.ws}{self.sep.join(members)}{self.ws}\}}" if members \
                else rf"\{{{self.ws}\}}"
        if isinstance(value, list):
            items = [self.literal(item, where) for item in value]
            return rf"\[{self.ws}{self.sep.join(items)}{self.ws}\]" if items \
                else rf"\[{self.ws}\]"
        return json_literal(value, where)

    def types(self, schema: dict, where: str) -> list[str] | None:
        """The declared types, else those the keywords imply; None: any JSON value."""
        declared = schema.get("type")
        if declared is None:
            return [t for t, keys in TYPE_KEYWORDS.items() if keys & set(schema)] or None
        declared = [declared] if isinstance(declared, str) else declared
        if not isinstance(declared, list) or not declared:
            raise ValueError(f"type at {where} must be a type name or a non-empty list")
        for name in declared:
            if name not in JSON_TYPES:
                raise ValueError(f"unknown type {name!r} at {where}")
        return list(dict.fromkeys(declared))

    def typed(self, schema: dict, json_type: str, where: str) -> str:
        if json_type == "string":
            return self.string(schema, where)
        if json_type == "object":
            return self.object(schema, where)
        if json_type == "array":
            return self.array(schema, where)
        return {"integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}[
            json_type]

    def string(self, schema: dict, where: str) -> str:
        lo = check_count(schema, "minLength", where) or 0
        hi = check_count(schema, "maxLength", where)
        shape = [key for key in ("format", "pattern") if key in schema]
        if len(shape) > 1 or (shape and ("minLength" in schema or "maxLength" in schema)):
            used = shape + [k for k in ("minLength", "maxLength") if k in schema]
            raise ValueError(f"string keywords {used} together at {where} are not supported")
        if "format" in schema:
            if schema["format"] not in FORMATS:
                raise ValueError(f"unsupported string format {schema['format']!r} at {where}"
                                 f" (supported: {sorted(FORMATS)})")
            return f'"{FORMATS[schema["format"]]}"'
        if "pattern" in schema:
            if not isinstance(schema["pattern"], str):
                raise ValueError(f"pattern at {where} must be a string")
            return f'"{restrict_regex(schema["pattern"], MUST_ESCAPE)}"'
        if hi is not None and hi < lo:
            raise ValueError(f"minLength {lo} > maxLength {hi} at {where}")
        return f'"{STRING_CHAR}{repeat(lo, hi)}"'

    def object(self, schema: dict, where: str) -> str:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        extra = schema.get("additionalProperties")
        if not isinstance(properties, dict):
            raise ValueError(f"properties at {where} must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"required at {where} must be a list of strings")
        missing = [name for name in required if name not in properties]
        if missing:
            raise ValueError(f"required {missing} at {where} not in properties")
        if not properties:
            return self.map(extra, where)
        if extra not in (None, False):
            raise ValueError(f"additionalProperties other than false beside properties at "
                             f"{where} is not supported")
        members = []
        for name, subschema in properties.items():
            try:
                value = self.value(subschema, f"{where}/properties/{name}")
            except _Unavailable:
                if name in required:
                    raise
                continue  # an optional property cut off by recursion: never written
            key = json_literal(name, where)
            members.append((f"{key}{self.ws}:{self.ws}{value}", name in required))
        return self.members_object(members)

    def map(self, extra, where: str) -> str:
        """An object of any keys whose values follow additionalProperties."""
        empty = rf"\{{{self.ws}\}}"
        if extra is False:
            return empty
        try:
            value = self.value(True if extra is None else extra,
                               f"{where}/additionalProperties")
        except _Unavailable:
            return empty
        return self.any_object(value)

    def members_object(self, members: list[tuple[str, bool]]) -> str:
        """Members in order; optional ones may be left out. The first member written has no
        comma before it, so each possible first member starts its own alternative (up to
        and including the first required one)."""
        if not members:
            return rf"\{{{self.ws}\}}"
        firsts = []
        for index, (member, required) in enumerate(members):
            firsts.append(member + "".join(
                f"{self.sep}{later}" if later_required else f"(?:{self.sep}{later})?"
                for later, later_required in members[index + 1:]))
            if required:
                break
        body = alternation(firsts)
        if any(required for _, required in members):
            return rf"\{{{self.ws}{body}{self.ws}\}}"
        return rf"\{{{self.ws}(?:{body}{self.ws})?\}}"

    def array(self, schema: dict, where: str) -> str:
        lo = check_count(schema, "minItems", where) or 0
        hi = check_count(schema, "maxItems", where)
        if schema.get("uniqueItems") not in (None, False):
            raise ValueError(f"uniqueItems at {where} is not supported")
        prefix, rest, rest_where = self.item_schemas(schema, where)
        cut = None
        prefix_regexes = []
        for index, subschema in enumerate(prefix):
            try:
                prefix_regexes.append(self.value(subschema, f"{where}/prefixItems/{index}"))
            except _Unavailable as error:
                cut, rest = error, False  # no item can come at or after this index
                break
        rest_regex = None
        if rest is not False:
            try:
                rest_regex = self.value(rest, rest_where)
            except _Unavailable as error:
                cut = cut or error
        if rest_regex is None:
            hi = len(prefix_regexes) if hi is None else min(hi, len(prefix_regexes))
        if hi is not None and lo > hi:
            if cut is not None:
                raise cut
            raise ValueError(f"at {where}, minItems {lo} exceeds the most items allowed, {hi}")
        return self.items_array(prefix_regexes[:hi], rest_regex, lo, hi)

    def item_schemas(self, schema: dict, where: str):
        """(prefix item schemas, schema of the rest or False, where the rest is described)."""
        items = schema.get("items", True)
        if isinstance(items, list):  # the tuple form of drafts before 2020-12
            if "prefixItems" in schema:
                raise ValueError(f"items as a list beside prefixItems at {where}")
            return items, schema.get("additionalItems", True), f"{where}/additionalItems"
        if "additionalItems" in schema:
            raise ValueError(f"additionalItems at {where} needs items to be a list")
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise ValueError(f"prefixItems at {where} must be a list of schemas")
        return prefix, items, f"{where}/items"

    def items_array(self, prefix: list[str], rest: str | None, lo: int, hi: int | None) -> str:
        """Items 0.. of the prefix, then repeats of rest; item i is optional when i >= lo
        (the later items are nested inside its optional group)."""
        if hi == 0:
            return rf"\[{self.ws}\]"
        leading = prefix or [rest]
        body = ""
        if rest is not None and (hi is None or hi > len(leading)):
            more_lo = max(lo - len(leading), 0)
            more_hi = None if hi is None else hi - len(leading)
            body = f"(?:{self.sep}{rest}){repeat(more_lo, more_hi)}"
        for index in range(len(leading) - 1, 0, -1):
            body = f"{self.sep}{leading[index]}{body}"
            if index >= lo:
                body = f"(?:{body})?"
        body = leading[0] + body
        if lo == 0:
            return rf"\[{self.ws}(?:{body}{self.ws})?\]"
        return rf"\[{self.ws}{body}{self.ws}\]"


def check_depth(max_depth: int) -> None:
    if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 0:
        raise ValueError(f"max_depth must be a non-negative integer, got {max_depth!r}")


def schema_to_regex(schema: dict | bool, whitespace: str = DEFAULT_WHITESPACE,
                    max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    """A regex for JSON text satisfying schema (see the module docstring for what differs
    from JSON Schema). whitespace is the regex allowed between tokens; none is allowed
    around the top-level value."""
    check_depth(max_depth)
    check_whitespace(whitespace)
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema must be an object or a boolean, got "
                         f"{type(schema).__name__}")
    try:
        return _SchemaCompiler(schema, whitespace, max_depth).value(schema, "#")
    except _Unavailable as error:
        raise ValueError(str(error)) from None


def any_json_regex(max_depth: int = DEFAULT_MAX_DEPTH,
                   whitespace: str = DEFAULT_WHITESPACE) -> str:
    """Any JSON value whose containers nest at most max_depth deep (0: scalars only)."""
    check_depth(max_depth)
    check_whitespace(whitespace)
    return _SchemaCompiler(True, whitespace, max_depth).any_value(max_depth)


def any_json_object_regex(max_depth: int = DEFAULT_MAX_DEPTH,
                          whitespace: str = DEFAULT_WHITESPACE) -> str:
    """Any JSON object (response_format json_object) with containers, itself included,
    nesting at most max_depth deep."""
    check_depth(max_depth)
    if max_depth < 1:
        raise ValueError("any_json_object_regex needs max_depth >= 1 (the object itself)")
    check_whitespace(whitespace)
    compiler = _SchemaCompiler(True, whitespace, max_depth)
    return compiler.any_object(compiler.any_value(max_depth - 1))
