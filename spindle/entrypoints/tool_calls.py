"""Tool calling (OpenAI's `tools` and `tool_choice`): which calls a chat answer makes.

Two ways, by tool_choice:

- "required", or a named function: structured outputs force the answer into a JSON
  document that is the call. A named function's answer is its arguments (the
  function's parameters schema); "required" answers a list of {"name", "parameters"}
  objects, one schema branch per tool. Any model can do this; nothing is parsed but
  JSON the automaton guaranteed. Streamed, each call opens once its name is read and
  its arguments follow as they are written (RequiredCallStream).
- "auto": the model decides, in its own format, which a tool call parser reads out of
  the text (TOOL_CALL_PARSERS). A server without a parser refuses "auto" with tools
  rather than return calls as plain text:
  - `hermes`: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Hermes,
    Qwen 2.5 / 3, and the many templates that copied them);
  - `llama3_json`: an answer that is {"name": ..., "parameters": {...}} objects, one or
    several joined by ";", after an optional <|python_tag|> (Llama 3.1 - 3.3);
  - `mistral`: [TOOL_CALLS] and a JSON list of {"name", "arguments"} (v0.3 tokenizers)
    or name[ARGS]{...} pieces (later ones). [TOOL_CALLS] is a special token, so its
    requests keep special tokens in the text.

"none" renders the tools into the prompt and returns plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MISTRAL_TAG = "[TOOL_CALLS]"
# name[ARGS]{...}: the arguments run to the next name[ARGS] or the end.
_MISTRAL_PIECE = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\](.*?)(?=[A-Za-z0-9_.-]+\[ARGS\]|$)",
                            re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as the OpenAI API returns it

    def to_openai(self) -> dict[str, Any]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's tools list, checked: ValueError naming the entry at fault."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', "
                         "'function': {...}} entries")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(function, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}, "
                             f"got {tool!r}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', "
                             f"'.' or '-', got {name!r}")
        if name in names:
            raise ValueError(f"tools[{i}]: a second function named {name!r}")
        names.add(name)
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, "
                             f"got {parameters!r}")
    return tools


def tool_choice_of(choice: Any, tools: list[dict] | None) -> str:
    """"none", "auto", "required", or the forced function's name; ValueError for a
    choice that names no given tool."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return choice
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(name, str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': "
                         f"'function', 'function': {{'name': ...}}}}, got {choice!r}")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise ValueError(f"tool_choice names the function {name!r}, which tools does not hold")
    return name


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def forced_schema(tools: list[dict], choice: str, parallel: bool = True) -> dict | None:
    """The JSON schema a forced choice's answer follows (None for "none" / "auto")."""
    if choice in ("none", "auto"):
        return None
    if choice != "required":
        (tool,) = [t for t in tools if t["function"]["name"] == choice]
        return _parameters(tool)
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": t["function"]["name"]},
                                      "parameters": _parameters(t)},
                       "required": ["name", "parameters"], "additionalProperties": False}
                      for t in tools]}
    return {"type": "array", "items": call, "minItems": 1, **({} if parallel else
                                                              {"maxItems": 1})}


def forced_calls(text: str, choice: str) -> list[ToolCall]:
    """The calls of an answer a forced choice's schema shaped (a finished one; ValueError
    for one cut short). A call's arguments are its parameters' text as the model wrote
    it, as a named function's are, and as a stream sends them (RequiredCallStream)."""
    if choice != "required":
        return [ToolCall(choice, text)]
    json.loads(text)  # (complete, or ValueError)
    return [ToolCall(call.name, text[call.arguments_start:call.arguments_end])
            for call in scan_required_calls(text)]


@dataclass
class PartialCall:
    """One call of a "required" answer as far as its text goes: its name once the name's
    string is closed, where its parameters' text starts once that key's value has begun,
    and where it ends once the value is closed."""

    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None


def scan_required_calls(text: str) -> list[PartialCall]:
    """The calls of a "required" answer (a JSON list of {"name", "parameters"} objects,
    keys in either order) read from as much of it as there is: a text cut anywhere
    gives the calls begun so far, the last one partly. Whatever is not such a list
    gives no calls."""
    calls: list[PartialCall] = []
    i = _list_start(text)
    i = None if i is None else _skip_space(text, i)
    while i is not None and i < len(text) and text[i] == "{":
        call, end = _scan_call(text, i)
        calls.append(call)
        i = None if end is None else _after_call(text, end)
    return calls


def _list_start(text: str) -> int | None:
    """The index past the list's "[", or None before it."""
    i = _skip_space(text, 0)
    return i + 1 if i < len(text) and text[i] == "[" else None


def _after_call(text: str, end: int) -> int:
    """Where the next call starts, from the end of one: past spaces and a comma."""
    i = _skip_space(text, end)
    return _skip_space(text, i + 1) if i < len(text) and text[i] == "," else i


def _scan_call(text: str, i: int, scans: dict[int, "_ValueScan"] | None = None
               ) -> tuple[PartialCall, int | None]:
    """The call object opening at text[i] ("{") as far as it goes, and the index past
    its "}" (None: not closed yet). scans: where earlier reads of the same growing text
    stopped inside its values (a stream's), so they are not read again."""
    call = PartialCall()
    i = _skip_space(text, i + 1)
    while i < len(text) and text[i] == '"':
        key_end = _string_end(text, i)
        if key_end is None:
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip_space(text, key_end)
        if i == len(text) or text[i] != ":":
            return call, None
        i = _skip_space(text, i + 1)
        if i == len(text):
            return call, None
        end = _value_end(text, i, scans)
        if key == "parameters":
            call.arguments_start, call.arguments_end = i, end
        elif key == "name" and end is not None:
            call.name = json.loads(text[i:end])
        if end is None:
            return call, None
        i = _skip_space(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_space(text, i + 1)
    if i == len(text) or text[i] != "}":
        return call, None
    return call, i + 1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The index past the JSON string that opens at text[i] (None: not closed yet)."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _value_end(text: str, i: int, scans: dict[int, "_ValueScan"] | None = None) -> int | None:
    """The index past the JSON value that starts at text[i] (None: not closed yet; a
    number or literal closes at the first character that cannot continue it). scans:
    as _scan_call's."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        while i < len(text) and text[i] not in ",}] \t\r\n":
            i += 1
        return i if i < len(text) else None
    scan = _ValueScan(i) if scans is None else scans.setdefault(i, _ValueScan(i))
    return scan.end(text)


class _ValueScan:
    """A read of an object or array value that starts at a given index: how deep it is
    and whether inside a string where the text read so far ends, so that a longer text
    is read on from there."""

    def __init__(self, start: int) -> None:
        self.pos, self.depth, self.in_string, self.escaped = start, 0, False, False
        self.closed_at: int | None = None

    def end(self, text: str) -> int | None:
        """The index past the value's closing bracket (None: not in text yet)."""
        i = self.pos
        while self.closed_at is None and i < len(text):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed_at = i + 1
            i += 1
        self.pos = i
        return self.closed_at


class RequiredCallStream:
    """A streamed "required" answer as tool-call deltas while it is written: each call's
    id, type and name once its name is read (an index of its own), then its
    arguments' text as it grows, so that a client sees the calls form as with a named
    function. feed(the answer's new text) -> the tool_calls entries to send.

    Each feed reads only the new text: the closed calls are kept, with where the next
    one starts; the open call's values are read on from where the last feed stopped
    (_ValueScan); calls whose arguments all went out are not looked at again."""

    def __init__(self) -> None:
        self.text = ""
        self.closed: list[PartialCall] = []  # the calls whose object is closed
        self.resume: int | None = None  # where the text after the last closed call starts
        self.sent: list[int] = []  # per call opened: how much of its arguments went out
        self.done = 0  # the first calls, closed and all sent
        self.scans: dict[int, _ValueScan] = {}  # (the open call's values, read so far)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        calls = self._calls()
        out = []
        for index in range(self.done, len(calls)):
            call = calls[index]
            if call.name is None:
                break  # (calls open in order: a later one waits for this name)
            entry: dict[str, Any] = {"index": index, "function": {}}
            if index == len(self.sent):
                opened = ToolCall(call.name, "").to_openai()
                entry.update(id=opened["id"], type="function")
                entry["function"]["name"] = call.name
                self.sent.append(0)
            new = "" if call.arguments_start is None else self.text[
                call.arguments_start + self.sent[index]:call.arguments_end or len(self.text)]
            self.sent[index] += len(new)
            if new or "id" in entry:
                entry["function"]["arguments"] = new
                out.append(entry)
            if index < len(self.closed) and index == self.done:
                self.done += 1
        return out

    def _calls(self) -> list[PartialCall]:
        """The closed calls and the open one, the text read from the last closed call on
        (as scan_required_calls reads it whole)."""
        if self.resume is None:
            self.resume = _list_start(self.text)
            if self.resume is None:
                return []
        i = (_after_call(self.text, self.resume) if self.closed
             else _skip_space(self.text, self.resume))
        while i < len(self.text) and self.text[i] == "{":
            call, end = _scan_call(self.text, i, self.scans)
            if end is None:
                return [*self.closed, call]
            self.closed.append(call)
            self.resume = end
            self.scans.clear()
            i = _after_call(self.text, end)
        return list(self.closed)


def _call_of(obj: object) -> ToolCall | None:
    """A {"name", "arguments" | "parameters"} object as a call (None: not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if arguments is None:
        return None
    return ToolCall(obj["name"], arguments if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> list | None:
    """The JSON values text holds one after another (whitespace or ";" between), or
    None when it holds anything else."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def llama3_json_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """An answer that is only call objects (after an optional <|python_tag|>); any
    other answer is content."""
    body = text.strip().removeprefix("<|python_tag|>")
    values = _json_values(body) if body.startswith("{") else None
    calls = [_call_of(v) for v in values or []]
    if not calls or None in calls:
        return text, []
    return None, calls


def mistral_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The content before [TOOL_CALLS]; after it a JSON list of calls, or
    name[ARGS]{arguments} pieces, each piece after its own [TOOL_CALLS] or not."""
    head, tag, rest = text.partition(_MISTRAL_TAG)
    if not tag:
        return text, []
    rest = rest.replace(_MISTRAL_TAG, "").strip()
    if rest.startswith("["):
        values = _json_values(rest)
        calls = [_call_of(v) for v in (values[0] if values and len(values) == 1
                                       and isinstance(values[0], list) else [None])]
    else:
        calls = [_call_of({"name": name, "arguments": _json_object(arguments)})
                 for name, arguments in _MISTRAL_PIECE.findall(rest)]
        if "".join(_MISTRAL_PIECE.sub("", rest).split()):
            calls = [None]  # (text between the pieces: not a call list)
    if not calls or None in calls:
        return text, []
    return head.rstrip() or None, calls


def hermes_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the content before the first call, or None when only calls; the calls) of a
    hermes-format answer. A block that is not a {"name", "arguments"} JSON object leaves
    the whole text as content, as a model's slip should not lose its answer."""
    blocks = _HERMES_BLOCK.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            call = _call_of(json.loads(block))
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:text.index("<tool_call>")].rstrip()
    return content or None, calls


# --tool-call-parser NAME -> how an "auto" answer is read: (content or None, calls).
TOOL_CALL_PARSERS = {"hermes": hermes_calls, "llama3_json": llama3_json_calls,
                     "mistral": mistral_calls}
# Parsers whose format starts with a special token the text must keep.
KEEPS_SPECIAL_TOKENS = ("mistral",)
# Where a parser's calls begin in an answer: text before it is content (None: the
# whole answer is calls or content, llama3_json's way).
CALL_MARKERS = {"hermes": "<tool_call>", "mistral": _MISTRAL_TAG, "llama3_json": None}
_PYTHON_TAG = "<|python_tag|>"


class ToolCallStream:
    """An auto answer streamed as content for as long as it surely is content: up to
    where calls may begin (a marker, or a piece of one, waits; so does the whitespace
    before it, which the parsers cut), or, for llama3_json, all of an answer that does
    not open like a call. The rest is read at the end with the parser: what was sent
    plus finish()'s content is the whole answer's content."""

    def __init__(self, parser: str) -> None:
        self.parse = TOOL_CALL_PARSERS[parser]
        self.marker = CALL_MARKERS[parser]
        self.text = ""
        self.sent = 0
        self.held = False  # calls may have begun: nothing more is sent before the end

    def feed(self, delta: str) -> str:
        """The content delta may add now."""
        self.text += delta
        if self.held:
            return ""
        if self.marker is None:
            head = self.text.lstrip()
            if head.startswith("{") or head.startswith(_PYTHON_TAG):
                self.held = True
                return ""
            if not head or _PYTHON_TAG.startswith(head):
                return ""
            return self._send(len(self.text))
        found = self.text.find(self.marker, self.sent)
        if found >= 0:
            self.held = True
            return self._send(len(self.text[:found].rstrip()))
        end = len(self.text) - _partial_suffix(self.text, self.marker)
        return self._send(len(self.text[:end].rstrip()))

    def _send(self, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def unsent(self) -> str:
        """The text not sent yet, as it is (an answer cut short: nothing is parsed)."""
        return self.text[self.sent:]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not sent yet, the calls) once the answer is whole."""
        content, calls = self.parse(self.text)
        content = content or ""
        if not content.startswith(self.text[:self.sent]):
            raise RuntimeError("tool call stream: content sent ahead of the parser's")
        return content[self.sent:], calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
