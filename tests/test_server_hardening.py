"""What users throw at a real `spindle serve`, through the official openai client and
raw HTTP: invalid Unicode, strict types, seeds at the edge, limits on the body and
on n, aborted requests the SDK's types can parse, the API key, CORS, JSON-only dev
routes, and a health check that sees a shut-down engine.

One server for the module (each start costs seconds): dev mode, an API key, one
allowed origin, a 1 MiB body limit and max_n 8. The test that shuts its workers
down comes last.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest

from server_utils import (StreamReader, metric_value, official_client, served, sse_events,
                          wait_for)
from spindle import LLM, SamplingParams
from spindle.entrypoints.openai.api_server import DEV_MODE_ENV

KEY = "sk-spindle-test-0123456789"
MAX_MODEL_LEN = 2048
BODY_LIMIT = 2**20
MAX_N = 8
ORIGIN = "https://app.example.com"
CHAT = [{"role": "user", "content": "Say something."}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model(arch="llama"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from served(tmp_path_factory, model_dir, "--device", "cpu", "--dtype", "float32",
                      "--max-model-len", str(MAX_MODEL_LEN),
                      "--served-model-name", "tiny", "org/tiny", "--api-key", KEY,
                      "--allowed-origins", ORIGIN, "--max-request-body-bytes", str(BODY_LIMIT),
                      "--max-n", str(MAX_N), env={DEV_MODE_ENV: "1"})


@pytest.fixture(scope="module")
def client(server):
    return official_client(server, KEY)


@pytest.fixture(scope="module")
def strict_client(server):
    """Validates every response against the SDK's types (finish reasons included)."""
    return official_client(server, KEY, _strict_response_validation=True)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c
        c.post("/resume", json={})  # whatever a test did, the next one finds it serving


def completion(http, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello",
                                              "max_tokens": 2, **body})


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_serving(http) -> None:
    assert http.get("/health").status_code == 200
    assert completion(http).status_code == 200


# ---- raw HTTP/1.1 on one connection ----------------------------------------------------------
def http_request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1",
             *(f"{k}: {v}" for k, v in {**AUTH, "Content-Length": len(body),
                                        **(headers or {})}.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length body: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection; got {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip()
               for k, v in (line.split(":", 1) for line in header_lines)}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-body")
        rest += chunk
    return int(status_line.split()[1]), headers, rest[:length]


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    return sock


# ---- invalid Unicode ----------------------------------------------------------------------------
# JSON may carry a lone surrogate as an escape: valid JSON, invalid Unicode.
SURROGATE_BODIES = {
    "/v1/completions": (b'{"model": "tiny", "prompt": "abc\\ud800def", "max_tokens": 2}',
                        "prompt"),
    "/v1/chat/completions": (b'{"model": "tiny", "max_tokens": 2, "messages": '
                             b'[{"role": "user", "content": "abc\\ud800def"}]}',
                             "messages.0.content"),
    "/v1/embeddings": (b'{"model": "tiny", "input": ["fine", "abc\\udfffdef"]}', "input.1"),
}
VALID = http_request("POST", "/v1/completions", json.dumps(
    {"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode(),
    {"Content-Type": "application/json"})


@pytest.mark.parametrize("route", list(SURROGATE_BODIES))
def test_lone_surrogate_is_400_and_the_connection_stays_open(server, route):
    body, param = SURROGATE_BODIES[route]
    with connect(server) as sock:
        for _ in range(2):  # twice, then a good request: all on the one connection
            sock.sendall(http_request("POST", route, body, {"Content-Type": "application/json"}))
            status, headers, payload = read_response(sock)
            assert status == 400, payload
            error = json.loads(payload)["error"]
            assert error["param"] == param and "surrogate" in error["message"], error
            assert error["type"] == "invalid_request_error"
            assert headers.get("connection") != "close"
        sock.sendall(VALID)
        status, _, payload = read_response(sock)
        assert status == 200, payload


def test_lone_surrogates_on_one_keep_alive_client(server):
    statuses = []
    with httpx.Client(base_url=server.url, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=60) as c:
        for route, (body, _) in SURROGATE_BODIES.items():
            statuses.append(c.post(route, content=body).status_code)
            statuses.append(c.post("/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                            "max_tokens": 2}).status_code)
    assert statuses == [400, 200] * 3


# ---- models ----------------------------------------------------------------------------------
def test_models_retrieve_with_the_official_client(strict_client):
    model = strict_client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model" and model.owned_by == "spindle"
    assert strict_client.models.retrieve("org/tiny").id == "org/tiny"  # sent as org%2Ftiny
    with pytest.raises(openai.NotFoundError) as info:
        strict_client.models.retrieve("gpt-9")
    assert info.value.code == "model_not_found" and "gpt-9" in info.value.message


# ---- aborted requests ------------------------------------------------------------------------
def _in_flight(http) -> float:
    return metric_value(http.get("/metrics").text, "spindle:num_requests_running")


def _pause_abort_once_running(http) -> None:
    assert wait_for(lambda: _in_flight(http) >= 1, timeout=30)
    assert http.post("/pause", json={"mode": "abort"}).status_code == 200


def test_aborted_whole_answer_is_an_error_the_sdk_parses(strict_client, http):
    caught: list[BaseException] = []

    def ask() -> None:
        try:
            strict_client.completions.create(model="tiny", prompt="Hello", max_tokens=1900,
                                             extra_body={"ignore_eos": True})
        except BaseException as e:  # noqa: BLE001 -- handed to the test thread
            caught.append(e)

    thread = threading.Thread(target=ask)
    thread.start()
    _pause_abort_once_running(http)
    thread.join(30)
    (error,) = caught
    assert isinstance(error, openai.InternalServerError), repr(error)
    assert error.status_code == 503 and error.code == "request_aborted", error
    assert http.post("/resume", json={}).status_code == 200
    answer = strict_client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_aborted_chat_stream_ends_with_an_error_the_sdk_raises(strict_client, http):
    stream = strict_client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=1900, stream=True, logprobs=True,
        extra_body={"ignore_eos": True})
    chunks = [next(stream), next(stream)]  # validated against ChatCompletionChunk
    _pause_abort_once_running(http)
    with pytest.raises(openai.APIError) as info:
        chunks.extend(stream)
    assert info.value.code == "request_aborted" and "aborted" in info.value.message
    assert all(c.choices[0].finish_reason is None for c in chunks)


def test_aborted_completion_stream_ends_with_an_error_the_sdk_raises(client, http):
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=1900,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    _pause_abort_once_running(http)
    with pytest.raises(openai.APIError) as info:
        chunks.extend(stream)
    assert info.value.code == "request_aborted"
    assert all(c.choices[0].finish_reason is None for c in chunks)


def test_finished_answers_pass_the_sdk_types(strict_client):
    chat = strict_client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                                 logprobs=True, top_logprobs=2)
    assert chat.choices[0].finish_reason in ("stop", "length")
    chunks = list(strict_client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 1
    text = strict_client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                            logprobs=2)
    assert text.choices[0].finish_reason in ("stop", "length")


# ---- logprobs describe the text --------------------------------------------------------------
def _ending_with_eos(http, route: str, **body) -> tuple[dict, dict]:
    """A sampled answer that ends with an end-of-sequence token: (request body,
    answer) for the first seed whose answer does (the tiny model is deterministic)."""
    for seed in range(40):
        request = {"model": "tiny", "max_tokens": 400, "temperature": 1.0, "seed": seed, **body}
        answer = http.post(route, json=request).json()
        choice = answer["choices"][0]
        if choice["finish_reason"] == "stop" and choice["stop_reason"] is None:
            return request, answer
    raise AssertionError(f"no seed in 0..39 made the tiny model end a {route} answer with EOS")


def _chat_ending_with_eos(http, **extra) -> tuple[dict, dict]:
    return _ending_with_eos(http, "/v1/chat/completions", messages=CHAT, logprobs=True,
                            top_logprobs=1, **extra)


def test_chat_logprobs_leave_out_the_eos_token_the_content_omits(http):
    request, answer = _chat_ending_with_eos(http)
    content = answer["choices"][0]["logprobs"]["content"]
    assert answer["choices"][0]["message"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] - 1
    assert not any(item["token"] in ("<|eos|>", "<|im_end|>") for item in content)
    # Streamed: the same logprobs, chunk by chunk.
    with http.stream("POST", "/v1/chat/completions",
                     json={**request, "stream": True}) as response:
        streamed = [item for event in sse_events(response) if event != "[DONE]"
                    for choice in event["choices"] if choice["logprobs"]
                    for item in choice["logprobs"]["content"]]
    assert [i["token"] for i in streamed] == [i["token"] for i in content]


def test_completion_logprobs_leave_out_the_eos_token_too(http):
    _, answer = _ending_with_eos(http, "/v1/completions", prompt="Say something.", logprobs=1)
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == answer["usage"]["completion_tokens"] - 1
    assert len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == len(
        logprobs["tokens"])


def test_skip_special_tokens_false_keeps_the_eos_in_text_and_logprobs(http):
    _, answer = _chat_ending_with_eos(http, skip_special_tokens=False)
    choice = answer["choices"][0]
    assert len(choice["logprobs"]["content"]) == answer["usage"]["completion_tokens"]
    assert choice["message"]["content"].endswith(choice["logprobs"]["content"][-1]["token"])


# ---- error objects name the field, the cause, the id -------------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 100},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
])
def test_param_names_the_field_at_fault(http, route, body, param):
    assert_error(http.post(route, json={"model": "tiny", **body}), 400, param)


def test_prompt_too_long_is_context_length_exceeded(client, http):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * MAX_MODEL_LEN, max_tokens=2)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert "max_model_len" in info.value.message
    chat = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]})
    assert_error(chat, 400, "messages", "context_length_exceeded")


def test_duplicate_request_id_is_refused_and_echoed(server, http):
    first = StreamReader(server.url, 600, headers={**AUTH, "X-Request-Id": "dup-7"})
    assert wait_for(lambda: first.chunks, timeout=30)
    second = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                 "max_tokens": 2},
                       headers={"X-Request-Id": "dup-7"})
    error = assert_error(second, 400, code="duplicate_request_id")
    assert "'dup-7'" in error["message"] and second.headers["x-request-id"] == "dup-7"
    first.join(60)
    assert first.done and first.finish_reason == "length" and first.error is None
    again = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                      headers={"X-Request-Id": "dup-7"})
    assert again.status_code == 200 and again.json()["id"] == "dup-7"


# ---- strict types --------------------------------------------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": "0.5"}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "hi", "seed": True}, "seed"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options":
                         {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": "true"}, "logprobs"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": 1}, "encoding_format"),
])
def test_strict_types_are_refused_naming_the_field(http, route, body, param):
    assert_error(http.post(route, json={"model": "tiny", **body}), 400, param)
    assert_serving(http)


def test_max_tokens_past_the_context_is_cut_as_offline(http):
    prompt = [5] * (MAX_MODEL_LEN - 8)
    answer = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                 "max_tokens": 10**6, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert answer.json()["usage"]["completion_tokens"] == 8


# ---- seeds -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,n", [(2**64, 1), (18446744073709551615, 2), (-(2**63) - 1, 1),
                                    (10**30, 1)])
def test_seed_outside_torchs_range_is_400(http, seed, n):
    error = assert_error(completion(http, seed=seed, n=n, temperature=1.0), 400, "seed")
    assert "seed" in error["message"]
    assert_serving(http)


@pytest.mark.parametrize("seed", [2**64 - 1, 2**63, -(2**63), -1, 0])
def test_seed_in_torchs_range_is_served(http, seed):
    answer = completion(http, seed=seed, temperature=1.0)
    assert answer.status_code == 200, answer.text
    assert http.get("/health").status_code == 200


def test_the_seed_in_the_issue_leaves_the_engine_serving(http):
    bad = completion(http, prompt="x", seed=18446744073709551615, n=2)
    assert_error(bad, 400, "seed")
    for _ in range(2):
        assert_serving(http)


# ---- n and body limits -------------------------------------------------------------------------
def test_n_over_the_limit_is_400_naming_n(http):
    error = assert_error(completion(http, n=MAX_N + 1), 400, "n")
    assert str(MAX_N) in error["message"]
    assert len(completion(http, n=MAX_N).json()["choices"]) == MAX_N


def test_llm_generate_refuses_n_over_max_n(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=128, max_n=2)
    try:
        with pytest.raises(ValueError, match=r"SamplingParams\.n must be at most max_n \(2\)"):
            llm.generate("Hello", SamplingParams(n=3, max_tokens=2), use_tqdm=False)
        assert len(llm.generate("Hello", SamplingParams(n=2, max_tokens=2),
                                use_tqdm=False)[0].outputs) == 2
    finally:
        llm.shutdown()


def test_body_over_the_declared_limit_is_413_before_it_is_sent(server):
    with connect(server) as sock:
        # Headers only: the answer must come without the server waiting for the body.
        head = http_request("POST", "/v1/completions", b"",
                            {"Content-Type": "application/json",
                             "Content-Length": BODY_LIMIT + 1})
        sock.sendall(head)
        status, _, payload = read_response(sock)
    assert status == 413
    error = json.loads(payload)["error"]
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]


def test_chunked_body_over_the_limit_is_413(http):
    def chunks():
        for _ in range(BODY_LIMIT // 65536 + 2):
            yield b" " * 65536

    response = http.post("/v1/completions", content=chunks(),
                         headers={"Content-Type": "application/json"})
    assert_error(response, 413, code="request_too_large")
    assert_serving(http)


def test_body_under_the_limit_is_read(http):
    prompt = [5] * (BODY_LIMIT // 4)  # "5, " per token: just under the limit
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
    assert len(response.request.content) < BODY_LIMIT
    assert_error(response, 400, "prompt", "context_length_exceeded")


# ---- the API key --------------------------------------------------------------------------------
def test_the_right_key_is_served_and_a_wrong_one_refused(server, client):
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=2).choices
    assert [m.id for m in client.models.list().data] == ["tiny", "org/tiny"]
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY + "x",
                      max_retries=0).chat.completions.create(model="tiny", messages=CHAT)


@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
    ("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("POST", "/pause"), ("POST", "/resume"),
    ("GET", "/is_paused"), ("POST", "/collective_rpc"), ("POST", "/sleep"),
    ("GET", "/docs"), ("GET", "/no/such/route")])
def test_every_route_but_health_metrics_version_needs_the_key(server, http, method, path):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        response = httpx.request(method, f"{server.url}{path}", headers=headers,
                                 json={"mode": "abort", "method": "shutdown"})
        error = assert_error(response, 401, code="invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer", error
    assert http.get("/is_paused").json()["is_paused"] is False
    assert_serving(http)


def test_health_metrics_version_stay_open(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert "spindle:num_requests_running" in httpx.get(f"{server.url}/metrics").text


def test_the_key_comes_from_the_flag_else_the_environment(monkeypatch, model_dir):
    import spindle.entrypoints.openai.api_server as api_server
    from spindle.entrypoints.cli import main

    calls = []
    monkeypatch.setattr(api_server, "run_server", lambda *a, **kw: calls.append(kw) or 0)
    monkeypatch.setenv("SPINDLE_API_KEY", "from-env")
    assert main(["serve", model_dir]) == 0
    assert main(["serve", model_dir, "--api-key", "from-flag"]) == 0
    monkeypatch.delenv("SPINDLE_API_KEY")
    assert main(["serve", model_dir]) == 0
    assert [c["server_args"].api_key for c in calls] == ["from-env", "from-flag", None]
    # Bad server flags are refused before the engine starts.
    assert main(["serve", model_dir, "--api-key", "two words"]) == 2
    assert main(["serve", model_dir, "--max-request-body-bytes", "0"]) == 2
    assert main(["serve", model_dir, "--allowed-methods", "GET"]) == 2
    assert len(calls) == 3


# ---- CORS and the dev routes -------------------------------------------------------------------
def test_cors_preflight_is_granted_to_the_allowed_origin_only(server):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{server.url}/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})

    granted = preflight(ORIGIN)
    assert granted.status_code == 200
    assert granted.headers["access-control-allow-origin"] == ORIGIN
    refused = preflight("https://evil.example")
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
    answer = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("path", ["/pause", "/sleep", "/collective_rpc", "/resume"])
@pytest.mark.parametrize("content_type,content", [
    ("application/x-www-form-urlencoded", b"mode=abort"),
    ("text/plain", b'{"mode": "abort", "method": "shutdown", "level": 0}'),
    ("multipart/form-data; boundary=x", b"--x--"),
    (None, b""),
])
def test_dev_routes_refuse_what_a_web_page_can_send_without_asking(http, path, content_type,
                                                                    content):
    headers = {"Content-Type": content_type} if content_type else {}
    response = http.post(path, content=content, headers=headers)
    assert_error(response, 415, code="unsupported_media_type")
    assert http.get("/is_paused").json()["is_paused"] is False
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
    assert http.get("/health").status_code == 200


def test_dev_routes_take_json_bodies(http):
    assert_error(http.post("/pause?mode=abort", json={}), 400)  # no query parameters
    assert_error(http.post("/pause", json={"mode": "nap"}), 400, "mode")
    assert_error(http.post("/pause", json={"mdoe": "wait"}), 400, "mdoe")
    assert_error(http.post("/pause", content=b"[1]",
                           headers={"Content-Type": "application/json"}), 400)
    assert http.post("/pause", json={"mode": "keep"}).json() == {"is_paused": True,
                                                                 "mode": "keep"}
    assert http.post("/resume", content=b"", headers={"Content-Type": "application/json"}
                     ).json() == {"is_paused": False}


# ---- last: it shuts the workers down -----------------------------------------------------------
def test_shutdown_rpc_makes_health_503_at_once(http):
    assert http.get("/health").status_code == 200
    assert http.post("/collective_rpc", json={"method": "shutdown"}).status_code == 200
    error = assert_error(http.get("/health"), 503)
    assert "shut down" in error["message"]
