"""Dev-mode control routes over HTTP: pause / resume in the three modes, is_paused,
sleep / wake_up, collective_rpc. The app runs in a thread of this process (on
127.0.0.1, a port picked at run time) around one AsyncLLM."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_utils import StreamReader, ThreadedServer, metric_value, wait_for
from spindle.config import EngineArgs
from spindle.engine.async_llm import AsyncLLM
from spindle.entrypoints.openai.api_server import DEV_MODE_ENV, build_app

MAX_MODEL_LEN = 2048
LONG = MAX_MODEL_LEN - 48  # tokens: a request that is still running when the test acts


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model(arch="llama")), device="cpu",
                                               dtype="float32", max_model_len=MAX_MODEL_LEN))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    srv = ThreadedServer(build_app(engine, ["tiny"], dev_mode=True))
    yield srv
    srv.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        # Leave the engine serving for the next test, whatever this one did.
        c.post("/resume", json={})
        c.post("/wake_up", json={})


def completion(http, max_tokens=8, **kw) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there",
                                              "max_tokens": max_tokens, "temperature": 0,
                                              "ignore_eos": True, **kw})


def background_completion(url: str, max_tokens: int):
    """A completion on its own connection, in a thread: a future of its response."""
    def post() -> httpx.Response:
        with httpx.Client(base_url=url, timeout=120) as c:
            return completion(c, max_tokens)

    pool = ThreadPoolExecutor(1)
    future = pool.submit(post)
    pool.shutdown(wait=False)
    return future


# ---- mounting -----------------------------------------------------------------------------
def _is_paused_status(app) -> int:
    async def get() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            return (await c.get("/is_paused")).status_code

    return asyncio.run(get())


def test_dev_routes_follow_the_environment_variable(engine, monkeypatch):
    monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    assert _is_paused_status(build_app(engine)) == 404
    monkeypatch.setenv(DEV_MODE_ENV, "0")
    assert _is_paused_status(build_app(engine)) == 404
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    assert _is_paused_status(build_app(engine)) == 200
    monkeypatch.setenv(DEV_MODE_ENV, "true")  # not a silent "off"
    with pytest.raises(ValueError, match=f"{DEV_MODE_ENV} must be 0 or 1, got 'true'"):
        build_app(engine)


# ---- pause ------------------------------------------------------------------------------------
def test_pause_abort_fails_in_flight_and_refuses_new_requests(server, http):
    readers = [StreamReader(server.url, LONG) for _ in range(2)]
    assert wait_for(lambda: all(r.chunks for r in readers), timeout=30)
    response = http.post("/pause", json={"mode": "abort"})
    assert response.status_code == 200 and response.json() == {"is_paused": True,
                                                               "mode": "abort"}
    for reader in readers:  # an aborted request ends with an error event (no finish reason)
        reader.join(30)
        assert reader.done and reader.error["code"] == "request_aborted", reader.error
    assert http.get("/is_paused").json() == {"is_paused": True, "mode": "abort"}
    refused = completion(http)
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    assert "paused" in refused.json()["error"]["message"]
    assert http.post("/resume", json={}).json() == {"is_paused": False}
    assert http.get("/is_paused").json() == {"is_paused": False, "mode": None}
    assert completion(http).status_code == 200


def test_pause_wait_lets_in_flight_finish_and_holds_new_ones(server, http):
    first = StreamReader(server.url, 300)
    assert wait_for(lambda: first.chunks, timeout=30)
    response = http.post("/pause", json={"mode": "wait"})  # returns once `first` is done
    assert response.status_code == 200
    first.join(30)
    assert first.finish_reason == "length"
    assert sum(len(c["choices"][0]["text"]) for c in first.chunks) > 0
    held = background_completion(server.url, 5)
    assert wait_for(lambda: metric_value(http.get("/metrics").text,
                                         "spindle:num_requests_waiting") == 1, timeout=10)
    time.sleep(0.3)
    assert not held.done()
    assert http.get("/is_paused").json() == {"is_paused": True, "mode": "wait"}
    http.post("/resume", json={})
    answer = held.result(timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5


def test_pause_keep_freezes_and_continues_with_identical_output(server, http):
    max_tokens = 200
    reference = completion(http, max_tokens).json()["choices"][0]["text"]
    reader = StreamReader(server.url, max_tokens)
    assert wait_for(lambda: reader.chunks, timeout=30)
    assert http.post("/pause", json={"mode": "keep"}).status_code == 200
    time.sleep(0.2)  # chunks already on the wire may still land
    frozen = len(reader.chunks)
    time.sleep(0.5)
    assert len(reader.chunks) == frozen and not reader.done
    held = background_completion(server.url, 3)
    time.sleep(0.2)
    assert not held.done()
    assert http.get("/is_paused").json() == {"is_paused": True, "mode": "keep"}
    http.post("/resume", json={})
    reader.join(60)
    assert reader.done and reader.finish_reason == "length"
    assert reader.text == reference
    assert held.result(timeout=30).status_code == 200


def test_bad_pause_mode_is_400(http):
    response = http.post("/pause", json={"mode": "nap"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert all(m in message for m in ("abort", "wait", "keep"))


# ---- sleep --------------------------------------------------------------------------------
def test_sleep_level_1_is_not_available_yet(http):
    response = http.post("/sleep", json={"level": 1})
    assert response.status_code == 501
    assert "sleep mode is not available" in response.json()["error"]["message"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert completion(http).status_code == 200


def test_sleep_level_0_pauses_scheduling_until_wake_up(http):
    assert http.post("/sleep", json={"level": 0}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = completion(http)
    assert refused.status_code == 503 and "sleeping" in refused.json()["error"]["message"]
    assert http.post("/wake_up", json={"tags": ["bogus"]}).status_code == 400
    assert http.post("/wake_up", json={"tags": ["scheduling"]}).json() == {"is_sleeping": False}
    assert completion(http).status_code == 200
    assert http.post("/sleep", json={"level": 7}).status_code == 400


# ---- collective_rpc ---------------------------------------------------------------------------
def test_collective_rpc_returns_json(http):
    beats = http.post("/collective_rpc", json={"method": "heartbeat"})
    assert beats.status_code == 200
    (beat,) = beats.json()["results"]
    assert beat["rank"] == 0 and "last_step" in beat
    report = http.post("/collective_rpc", json={"method": "lifecycle_report"}).json()["results"]
    assert [row["stage"] for row in report[0]][0] == "init_device"


@pytest.mark.parametrize("method", ["no_such_method", "_stage", "a.b"])
def test_collective_rpc_refuses_bad_methods(http, method):
    response = http.post("/collective_rpc", json={"method": method})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "method"


# ---- the error boundary (an app of its own around this module's engine) --------------------------
def test_an_unexpected_exception_is_a_500_and_the_connection_stays_open(engine):
    import json
    import socket

    app = build_app(engine, ["tiny"])

    @app.get("/boom")
    async def boom() -> None:
        raise TypeError("a bug")

    srv = ThreadedServer(app)
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            replies = []
            for path in ("/boom", "/boom", "/health"):  # one connection for all three
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                replies.append(_read_response(sock))
    finally:
        srv.stop()
    assert [status for status, _ in replies] == [500, 500, 200]
    error = json.loads(replies[0][1])["error"]
    assert error["type"] == "server_error" and "TypeError('a bug')" in error["message"]


def _read_response(sock) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(head.split()[1]), body[:length]
