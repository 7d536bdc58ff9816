"""Tool calling: the official openai client against `spindle serve --tool-call-parser
hermes`. Forced choices (a named function, "required") come back as calls whose
arguments the `jsonschema` package validates against the tool's parameters, equal to
what offline structured outputs give; "auto" reads hermes blocks; the tools and past
calls reach the chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server_utils import official_client, served
from spindle import LLM, SamplingParams, StructuredOutputsParams
from spindle.entrypoints.chat_utils import chat_messages
from spindle.entrypoints.tool_calls import check_tools, forced_calls, forced_schema, tool_choice_of

WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
# A chat template that shows the tools and renders past calls the way Qwen's does.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{%- for t in tools %}{{ t.function.name }}: "
    "{{ t.function.parameters | tojson }}\n{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{%- endfor %}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- endif %}")
FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from served(tmp_path_factory, str(tiny_model(arch="llama")), *FLAGS,
                      "--served-model-name", "tiny", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server):
    return official_client(server)


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(str(tiny_model(arch="llama")), device="cpu", dtype="float32", max_model_len=1024)
    yield llm
    llm.shutdown()


def _offline_text(offline, schema: dict) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(json=schema))
    return offline.chat(CHAT, params, use_tqdm=False, chat_template=TEMPLATE,
                        tools=TOOLS)[0].outputs[0].text


def test_a_named_function_is_called_with_arguments_of_its_schema(client, offline):
    response = client.chat.completions.create(
        model="tiny", messages=CHAT, tools=TOOLS, temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"chat_template": TEMPLATE})
    choice = response.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert call.function.arguments == _offline_text(offline, WEATHER)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_name_given_tools_with_valid_arguments(client, offline, parallel):
    response = client.chat.completions.create(
        model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=200, parallel_tool_calls=parallel, extra_body={"chat_template": TEMPLATE})
    calls = response.choices[0].message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    want = json.loads(_offline_text(offline, forced_schema(TOOLS, "required", parallel)))
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(w["name"], w["parameters"]) for w in want]


def test_auto_reads_hermes_blocks(client):
    """tool_choice auto: the answer (here shaped by a regex into a hermes block) is read
    by the hermes parser into a call; text before it stays content."""
    block = (r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "[a-z]{1,5}"\}\}'
             r'</tool_call>')
    response = client.chat.completions.create(
        model="tiny", messages=CHAT, tools=TOOLS, temperature=0, max_tokens=80,
        extra_body={"chat_template": TEMPLATE, "structured_outputs": {"regex": block}})
    message = response.choices[0].message
    assert message.content == "Sure."
    (call,) = message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    assert response.choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS,
                                           temperature=0, max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    # Streamed: the content first, the call in the last chunk.
    chunks = list(client.chat.completions.create(
        model="tiny", messages=CHAT, tools=TOOLS, temperature=0, max_tokens=80, stream=True,
        extra_body={"chat_template": TEMPLATE, "structured_outputs": {"regex": block}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure."
    (streamed,) = [t for d in deltas for t in d.tool_calls or []]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name,
                                                                     call.function.arguments)
    assert deltas[-1].tool_calls and not deltas[-2].tool_calls
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_streamed_named_call_streams_its_arguments(client):
    """Its id and name first, then argument deltas whose concatenation is the whole
    answer's arguments."""
    body = dict(model="tiny", messages=CHAT, tools=TOOLS, temperature=0, max_tokens=80,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(stream=True, **body,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    parts = [t for d in deltas for t in d.tool_calls or []]
    assert len(parts) > 2 and all(p.index == 0 for p in parts)
    assert parts[0].id and parts[0].function.name == "get_weather"
    assert all(p.id is None and p.function.name is None for p in parts[1:])
    assert "".join(p.function.arguments for p in parts) == whole.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_required_calls_stream_their_arguments(client, parallel):
    """Each call opens with its index, id and name, then its arguments come in deltas:
    per call, their concatenation is the whole answer's arguments."""
    body = dict(model="tiny", messages=CHAT, tools=TOOLS, temperature=0, max_tokens=200,
                tool_choice="required", parallel_tool_calls=parallel,
                extra_body={"chat_template": TEMPLATE})
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    parts = [t for d in deltas for t in d.tool_calls or []]
    assert len(parts) > len(whole) + 1  # (the arguments came in pieces)
    for index, call in enumerate(whole):
        mine = [p for p in parts if p.index == index]
        assert mine[0].id and mine[0].function.name == call.function.name
        assert all(p.id is None and p.function.name is None for p in mine[1:])
        assert "".join(p.function.arguments or "" for p in mine) == call.function.arguments
    assert {p.index for p in parts} == set(range(len(whole)))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_required_call_stream_reads_a_list_however_it_is_cut(step):
    """The scanner behind it: strings holding braces, quotes and commas, nested values,
    whitespace anywhere, and a call whose parameters come before its name (its
    arguments wait for the name), fed in pieces of any size."""
    from spindle.entrypoints.tool_calls import RequiredCallStream

    text = (' [ {"name": "get_weather", "parameters": {"city": "P\\"a}r,is", "n": [1, '
            '{"a": {}}]} } ,\n{"parameters":{"zone":"x"},"name":"get_time"}]')
    stream, entries = RequiredCallStream(), []
    for i in range(0, len(text), step):
        entries += stream.feed(text[i:i + step])
    names = {e["index"]: e["function"]["name"] for e in entries if "name" in e["function"]}
    arguments = {}
    for e in entries:
        arguments[e["index"]] = arguments.get(e["index"], "") + e["function"]["arguments"]
    assert names == {0: "get_weather", 1: "get_time"}
    assert [json.loads(arguments[i]) for i in (0, 1)] == [
        {"city": 'P"a}r,is', "n": [1, {"a": {}}]}, {"zone": "x"}]
    assert [(c.name, c.arguments) for c in forced_calls(text, "required")] == [
        ("get_weather", arguments[0]), ("get_time", arguments[1])]
    with pytest.raises(ValueError):
        forced_calls(text[:-3], "required")


def test_a_conversation_with_past_calls_and_results_is_served(client):
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    response = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                              tool_choice="none", temperature=0, max_tokens=6,
                                              extra_body={"chat_template": TEMPLATE})
    assert response.choices[0].message.content and not response.choices[0].message.tool_calls


def test_the_template_sees_the_tools_and_past_arguments_as_objects(offline):
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    text = offline.render_chat(history, chat_template=TEMPLATE, tools=TOOLS)["prompt"]
    assert f"get_weather: {json.dumps(WEATHER)}" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "integer", "minimum": 2}}}],
      "tool_choice": "required"}, None),
])
def test_bad_tool_requests_get_400(server, body, param):
    import httpx

    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"model": "tiny", "messages": CHAT, **body}, timeout=60)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_tool_helpers():
    assert tool_choice_of(None, TOOLS) == "auto" and tool_choice_of(None, None) == "none"
    assert forced_schema(TOOLS, "get_time") == TIME
    assert [c.name for c in forced_calls('[{"name": "get_time", "parameters": {"zone": "x"}}]',
                                         "required")] == ["get_time"]
    with pytest.raises(ValueError, match="second function"):
        check_tools(TOOLS + TOOLS[:1])
    (message,) = chat_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": [1]}
    with pytest.raises(ValueError, match="not valid JSON"):
        chat_messages([{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{"}}]}])


@pytest.mark.parametrize("parser, text, content, calls", [
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
     '{"name": "g", "parameters": {}}', None, [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", ' {"name": "f", "arguments": {"a": [1, 2]}}\n', None, [("f", {"a": [1, 2]})]),
    ("llama3_json", 'It is sunny. {"name": "f", "parameters": {}}', "same", []),
    ("llama3_json", '{"name": "f", "parameters": {}} and more', "same", []),
    ("llama3_json", '{"city": "Oslo"}', "same", []),
    ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, '
     '{"name": "g", "arguments": {}}]', "Let me check.", [("f", {"x": 1}), ("g", {})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{"y": "a b"}', None,
     [("f", {"x": 1}), ("g", {"y": "a b"})]),
    ("mistral", "[TOOL_CALLS]f[ARGS]{not json}", "same", []),
    ("mistral", "[TOOL_CALLS] sorry, no", "same", []),
    ("mistral", "no calls here", "same", []),
    ("hermes", 'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
     '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "a", [("f", {"x": 1}), ("g", {})]),
    ("hermes", "<tool_call>{not json}</tool_call>", "same", []),
    ("hermes", "plain", "same", []),
])
def test_tool_call_parsers(parser, text, content, calls):
    from spindle.entrypoints.tool_calls import TOOL_CALL_PARSERS

    got_content, got = TOOL_CALL_PARSERS[parser](text)
    assert got_content == (text if content == "same" else content)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Let me look.  \n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'),
    ("hermes", "  plain answer <tool_ no tag"),
    ("hermes", "bad <tool_call>{nope}</tool_call> end"),
    ("hermes", '<tool_call>{"name": "g", "arguments": {}}</tool_call>'),
    ("hermes", "trailing   "),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "f", "arguments": {}}]'),
    ("mistral", "no [TOOL_ calls"),
    ("llama3_json", ' {"name": "f", "parameters": {}}'),
    ("llama3_json", "It is 5 {not}"),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}'),
    ("llama3_json", "<|pyt"),
])
def test_an_auto_answer_streamed_in_any_pieces_gives_the_whole_answers_content_and_calls(
        parser, text):
    import random

    from spindle.entrypoints.tool_calls import TOOL_CALL_PARSERS, ToolCallStream

    content, calls = TOOL_CALL_PARSERS[parser](text)
    for seed in range(30):
        rng, stream, sent, i = random.Random(seed), ToolCallStream(parser), "", 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            sent, i = sent + stream.feed(text[i:j]), j
        rest, got = stream.finish()
        assert ((sent + rest) or None, got) == (content, calls)
