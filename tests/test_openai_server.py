"""The official openai client against a real `spindle serve` on 127.0.0.1: answers
equal to offline LLM.generate, streaming, n > 1, logprobs, usage, validation,
client disconnects and metrics. One server for the whole module."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from server_utils import metric_value, official_client, served, sse_events, wait_for
from spindle import LLM, SamplingParams, StructuredOutputsParams

MAX_MODEL_LEN = 2048
ENGINE_FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN))
PROMPTS = ["Hello, my name is", "def fibonacci(n):"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yield from served(tmp_path_factory, str(tiny_model(arch="llama")), *ENGINE_FLAGS,
                      "--served-model-name", "tiny", "tiny-alias")


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(str(tiny_model(arch="llama")), device="cpu", dtype="float32",
              max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return official_client(server)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ---- answers equal the offline engine's ------------------------------------------------
def test_completions_equal_offline_generate(client, offline):
    expected = offline.generate(PROMPTS, greedy(), use_tqdm=False)
    response = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=24,
                                         temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    for choice, want in zip(response.choices, expected):
        assert choice.text == want.outputs[0].text
        assert choice.finish_reason == want.outputs[0].finish_reason
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == 48
    assert response.usage.total_tokens == response.usage.prompt_tokens + 48
    assert response.model == "tiny" and response.object == "text_completion"


def test_streamed_completion_equals_offline_and_ends_with_usage(client, offline):
    expected = offline.generate(PROMPTS[0], greedy(40), use_tqdm=False)[0]
    chunks = list(client.completions.create(model="tiny-alias", prompt=PROMPTS[0], max_tokens=40,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].model == "tiny-alias"


def test_chat_equals_offline_chat(client, offline):
    expected = offline.chat(CHAT, greedy(30), use_tqdm=False)[0]
    response = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30,
                                              temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")


def test_streamed_chat_equals_offline_chat(client, offline):
    expected = offline.chat(CHAT, greedy(30), use_tqdm=False)[0]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30


def test_stop_string_is_cut_from_streamed_text(client, offline):
    full = offline.generate(PROMPTS[1], greedy(40), use_tqdm=False)[0].outputs[0].text
    stop = full[10:13]
    expected = offline.generate(PROMPTS[1], greedy(40, stop=[stop]), use_tqdm=False)[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_samples_with_seed_equal_offline(client, offline):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    expected = offline.generate(PROMPTS[0], params, use_tqdm=False)[0]
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], n=3, temperature=1.0,
                                         seed=7, max_tokens=12, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == \
        [o.text for o in expected.outputs]
    assert response.usage.completion_tokens == 36
    chat = client.chat.completions.create(model="tiny", messages=CHAT, n=2, max_tokens=5,
                                          stream=True)
    indices = {c.choices[0].index for c in chat if c.choices}
    assert indices == {0, 1}


def test_completion_logprobs_equal_offline(client, offline):
    expected = offline.generate(PROMPTS[0], greedy(8, logprobs=3), use_tqdm=False)[0].outputs[0]
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                         temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token_id, entry, got, top in zip(expected.token_ids, expected.logprobs,
                                         lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert 3 <= len(top) <= 4  # the top 3, plus the sampled token if it is not among them
    assert lp.text_offset[0] == 0


def test_chat_logprobs_have_top_k(client):
    response = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6,
                                              temperature=0, logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 2
        # Greedy: the sampled token is the most likely one.
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_sampling_parameters_are_accepted(client):
    response = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0.8, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, seed=1,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    assert response.usage.completion_tokens == 10


def test_echo_prepends_the_prompt(client):
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4,
                                         temperature=0, echo=True)
    assert response.choices[0].text.startswith(PROMPTS[0])


def test_echo_with_logprobs_scores_the_prompt_too(client, offline):
    """The legacy way to score a text (what evaluation harnesses send): the echoed
    prompt's tokens come first in the logprobs lists, the first with None."""
    want = offline.generate(PROMPTS[1], greedy(3, logprobs=2, prompt_logprobs=2),
                            use_tqdm=False)[0]
    ids, sample = want.prompt_token_ids, want.outputs[0]
    for stream in (False, True):
        response = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3,
                                             temperature=0, echo=True, logprobs=2,
                                             stream=stream)
        if stream:  # (the first chunk echoes the prompt with its logprobs)
            chunks = [c.choices[0] for c in response if c.choices]
            lp = chunks[0].logprobs
            for chunk in chunks[1:]:
                for key in ("tokens", "token_logprobs", "text_offset"):
                    getattr(lp, key).extend(getattr(chunk.logprobs, key))
        else:
            lp = response.choices[0].logprobs
            assert response.choices[0].text == PROMPTS[1] + sample.text
        assert len(lp.tokens) == len(ids) + 3
        assert lp.token_logprobs[0] is None
        for j in range(1, len(ids)):
            assert lp.token_logprobs[j] == pytest.approx(want.prompt_logprobs[j][ids[j]].logprob)
        for j, token in enumerate(sample.token_ids):
            assert lp.token_logprobs[len(ids) + j] == pytest.approx(
                sample.logprobs[j][token].logprob)
        assert lp.text_offset == sorted(lp.text_offset)
    assert response is not None


def test_prompt_logprobs_field_as_vllm_gives_it(http, offline):
    want = offline.generate(PROMPTS[0], greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
    body = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0],
                                              "max_tokens": 2, "temperature": 0,
                                              "prompt_logprobs": 1}).json()
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for entry, expected in zip(got[1:], want.prompt_logprobs[1:]):
        assert {int(t) for t in entry} == set(expected)
        for token, lp in expected.items():
            assert entry[str(token)]["logprob"] == pytest.approx(lp.logprob)
            assert entry[str(token)]["rank"] == lp.rank
    events = [e for e in sse_events(http.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0,
        "prompt_logprobs": 1, "stream": True})) if e != "[DONE]"]
    assert events[0]["choices"][0]["prompt_logprobs"] == got
    assert all("prompt_logprobs" not in e["choices"][0] for e in events[1:] if e["choices"])
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT,
                                                   "max_tokens": 2, "prompt_logprobs": 0})
    prompt_logprobs = chat.json()["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) > 5
    assert all(len(entry) == 1 for entry in prompt_logprobs[1:])
    bad = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                             "prompt_logprobs": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("prompt_logprobs")


def test_logit_bias_steers_sampling_as_offline(client, offline):
    """A token biased by +100 is every greedy token; the answer equals the offline
    engine's with the same bias."""
    token = offline.generate(PROMPTS[0], greedy(1), use_tqdm=False)[0].outputs[0].token_ids[0]
    forced = (token + 7) % 400
    want = offline.generate(PROMPTS[0], greedy(4, logit_bias={forced: 100.0}, logprobs=0),
                            use_tqdm=False)[0].outputs[0]
    assert want.token_ids == [forced] * 4
    piece = want.logprobs[0][forced].decoded_token
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4,
                                         temperature=0, logit_bias={str(forced): 100})
    assert response.choices[0].text == want.text
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                          temperature=0, logit_bias={str(forced): 100},
                                          logprobs=True)
    assert [item.token for item in chat.choices[0].logprobs.content] == [piece] * 3


COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "bright": {"type": "boolean"}},
         "required": ["color", "bright"], "additionalProperties": False}


def test_response_format_json_schema_equals_offline_structured_outputs(client, offline):
    """The official client's response_format (json_schema, json_object) and vLLM's
    structured_outputs field give what LLM.chat / LLM.generate give offline."""
    schema_params = greedy(60, structured_outputs=StructuredOutputsParams(json=COLOR))
    expected = offline.chat(CHAT, schema_params, use_tqdm=False)[0].outputs[0]
    response = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "color", "schema": COLOR, "strict": True}})
    assert response.choices[0].message.content == expected.text
    assert expected.finish_reason == "stop"
    assert set(json.loads(expected.text)) == {"color", "bright"}
    json_object = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=60, temperature=0,
        response_format={"type": "json_object"})
    want = offline.chat(CHAT, greedy(60, structured_outputs=StructuredOutputsParams(
        json_object=True)), use_tqdm=False)[0].outputs[0].text
    assert json_object.choices[0].message.content == want
    regex = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20,
                                      temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[a-z]{3}"}})
    assert regex.choices[0].text == offline.generate(PROMPTS[0], greedy(20, structured_outputs=(
        StructuredOutputsParams(regex="[a-z]{3}"))), use_tqdm=False)[0].outputs[0].text


def test_request_id_from_header_is_the_response_id(client, http):
    response = client.completions.with_raw_response.create(
        model="tiny", prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "req-abc-1"})
    assert response.headers["x-request-id"] == "req-abc-1"
    assert response.parse().id == "req-abc-1"


def test_models_health_version(client, http):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


# ---- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": 12}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": "many"}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1] * MAX_MODEL_LEN}, None),
    ("/v1/completions", {"prompt": "word " * (MAX_MODEL_LEN + 10)}, None),
    ("/v1/completions", {"prompt": [[1, 2], [10**9]]}, None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"one": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 500}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 5}}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                       "maximum": 3}}}}, None),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # (no parser)
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "(a"}}, None),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "x"}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     None),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(http, route, body, param):
    response = http.post(route, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                              "max_tokens": 2}).status_code == 200


def test_over_long_prompt_names_the_limit(http):
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 3000})
    assert response.status_code == 400
    assert "max_model_len" in response.json()["error"]["message"]


def test_malformed_json_is_400(http):
    response = http.post("/v1/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert "gpt-9" in info.value.message
    chat = http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": CHAT})
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def test_official_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=CHAT, temperature=-0.5)


# ---- disconnects ---------------------------------------------------------------------------
def _in_flight(http) -> float:
    text = http.get("/metrics").text
    return (metric_value(text, "spindle:num_requests_running")
            + metric_value(text, "spindle:num_requests_waiting"))


def _aborted(http) -> float:
    return metric_value(http.get("/metrics").text, "spindle:request_success_total",
                        finished_reason="abort")


def test_disconnect_mid_stream_aborts_the_request(server, http):
    aborted_before = _aborted(http)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_MODEL_LEN - 20,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=body) as response:
            events = sse_events(response)
            next(events), next(events)
            assert _in_flight(http) == 1
    # The connection is closed: the engine must drop the request.
    assert wait_for(lambda: _in_flight(http) == 0, timeout=10)
    assert wait_for(lambda: _aborted(http) == aborted_before + 1, timeout=5)


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server, http):
    aborted_before = _aborted(http)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_MODEL_LEN - 20,
            "ignore_eos": True}

    def impatient_client():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(
                60, read=0.5))

    thread = threading.Thread(target=impatient_client)
    thread.start()
    assert wait_for(lambda: _in_flight(http) == 1, timeout=10)
    thread.join()
    assert wait_for(lambda: _in_flight(http) == 0, timeout=10)
    assert wait_for(lambda: _aborted(http) == aborted_before + 1, timeout=5)


# ---- metrics -------------------------------------------------------------------------------
def test_metrics_exist_and_move(http, client):
    names = ["spindle:num_requests_running", "spindle:num_requests_waiting",
             "spindle:kv_cache_usage_perc", "spindle:prompt_tokens_total",
             "spindle:generation_tokens_total", "spindle:time_to_first_token_seconds_count",
             "spindle:inter_token_latency_seconds_count",
             "spindle:e2e_request_latency_seconds_count"]
    before = http.get("/metrics")
    assert before.headers["content-type"].startswith("text/plain")
    for name in names:
        assert name.removesuffix("_count").removesuffix("_total") in before.text, name
    values = {n: metric_value(before.text, n) for n in names}
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=7,
                                         temperature=0)
    after = http.get("/metrics").text
    moved = {n: metric_value(after, n) - values[n] for n in names}
    assert moved["spindle:prompt_tokens_total"] == response.usage.prompt_tokens
    assert moved["spindle:generation_tokens_total"] == 7
    assert moved["spindle:time_to_first_token_seconds_count"] == 1
    assert moved["spindle:inter_token_latency_seconds_count"] >= 1
    assert moved["spindle:e2e_request_latency_seconds_count"] == 1
    assert metric_value(after, "spindle:request_success_total", finished_reason="length") >= 1
    assert metric_value(after, "spindle:num_requests_running", model_name="tiny") == 0


# ---- dev routes are off without SPINDLE_SERVER_DEV_MODE=1 -------------------------------------
@pytest.mark.parametrize("method,path", [
    ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/pause"),
    ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/collective_rpc")])
def test_dev_routes_are_404_without_dev_mode(http, method, path):
    response = http.request(method, path, json={"method": "heartbeat"})
    assert response.status_code == 404
    assert "error" in response.json()


def test_cors_is_off_by_default(server):
    evil = "https://evil.example"
    preflight = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": evil, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in preflight.headers
    answer = httpx.get(f"{server.url}/v1/models", headers={"Origin": evil})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_tokenize_and_detokenize(http, offline):
    """vLLM's /tokenize and /detokenize: a prompt's ids are those the engine takes (the
    offline engine's prompt_token_ids for the same text), a conversation's those of
    the chat template, and /detokenize gives the text back; bad bodies get 400."""
    tokenizer = offline.get_tokenizer()
    prompt = PROMPTS[0]
    answer = http.post("/tokenize", json={"model": "tiny", "prompt": prompt,
                                          "return_token_strs": True}).json()
    expected = offline.generate([prompt], greedy(1), use_tqdm=False)[0].prompt_token_ids
    assert answer["tokens"] == list(expected) and answer["count"] == len(expected)
    assert answer["max_model_len"] == MAX_MODEL_LEN
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(list(expected))
    chat = http.post("/tokenize", json={"model": "tiny", "messages": CHAT}).json()
    assert chat["tokens"] == offline.render_chat(CHAT)["prompt_token_ids"]
    back = http.post("/detokenize", json={"model": "tiny", "tokens": answer["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(answer["tokens"])
    for route, body in (("/tokenize", {"model": "tiny"}),
                        ("/tokenize", {"model": "tiny", "prompt": "a", "messages": CHAT}),
                        ("/detokenize", {"model": "tiny", "tokens": [10 ** 9]}),
                        ("/detokenize", {"model": "tiny", "tokens": ["a"]})):
        assert http.post(route, json=body).status_code == 400, (route, body)
    assert http.post("/tokenize", json={"model": "nope", "prompt": "a"}).status_code == 404


def test_a_priority_needs_the_priority_policy(http):
    """(vLLM's extension field) A server scheduling first come, first served refuses a
    request priority other than 0, naming the flag; priority 0 serves."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    answer = http.post("/v1/completions", json={**body, "priority": 3})
    assert answer.status_code == 400 and "--scheduling-policy priority" in answer.text
    assert http.post("/v1/completions", json={**body, "priority": 0}).status_code == 200


def test_lora_adapter_routes_are_off_by_default(http):
    """Adding adapters at run time needs --allow-runtime-lora-updating."""
    for route in ("load", "unload"):
        answer = http.post(f"/v1/{route}_lora_adapter", json={"lora_name": "x",
                                                               "lora_path": "/x"})
        assert answer.status_code == 404


# ---- the command line ------------------------------------------------------------------------
def test_serve_flags_come_from_engine_args(capsys):
    from spindle.entrypoints.cli import build_parser, main
    from spindle.entrypoints.cli_args import engine_args_from

    ns = build_parser().parse_args(["serve", "/m", "--port", "0", "--max-num-seqs", "4",
                                    "--tensor-parallel-size", "2", "--served-model-name", "a",
                                    "b"])
    assert (ns.model_path, ns.port, ns.host, ns.served_model_name) == (["/m"], 0, "127.0.0.1",
                                                                       ["a", "b"])
    args = engine_args_from(ns, model=ns.model_path[0])
    assert (args.max_num_seqs, args.tensor_parallel_size) == (4, 2)
    assert main(["serve", "/one", "--model", "/two"]) == 2
    assert "models given twice" in capsys.readouterr().err


def test_the_server_socket_listens_before_the_serving_line_is_logged():
    """A client that connects as soon as it reads "serving ... on" must not be refused:
    the socket listens before the line is logged, and uvicorn accepts from its backlog."""
    import socket

    from spindle.entrypoints.openai.api_server import _bind

    sock = _bind("127.0.0.1", 0)
    try:
        client = socket.create_connection(sock.getsockname(), timeout=5)  # refused if not listening
        client.close()
    finally:
        sock.close()
