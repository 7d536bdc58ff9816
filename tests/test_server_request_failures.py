"""No single request may kill a real `spindle serve`: a request whose preparation in
the model runner fails gets an error response of its own (400 when its values were
refused, 500 `request_failed` otherwise; in-band when streaming), and the next
requests and /health are served as before. Failures are injected by
fault_shim/sitecustomize.py, which the server process loads through PYTHONPATH.
Seeds: the whole range torch takes works with n > 1; beyond it, a 400 naming seed."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from server_utils import RemoteServer, StreamReader, sse_events, wait_for

SHIM = Path(__file__).parent / "fault_shim"
REFUSED = [7, 7, 7, 7, 9]  # the shim raises ValueError preparing prompts starting 7,7,7,7
BROKEN = [8, 8, 8, 8, 9]  # ... and RuntimeError for 8,8,8,8
FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
         "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    env = {"PYTHONPATH": os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")]),
           "SPINDLE_TEST_PREPARE_FAULTS": "7,7,7,7=ValueError;8,8,8,8=RuntimeError"}
    srv = RemoteServer(str(tiny_model(arch="llama")), *FLAGS, env=env,
                       log_path=tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def complete(http, prompt, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                              "max_tokens": 4, **body})


def assert_still_serving(http) -> None:
    assert http.get("/health").status_code == 200
    response = complete(http, "Hello there", temperature=0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("prompt,status,kind", [(REFUSED, 400, "invalid_request_error"),
                                                (BROKEN, 500, "server_error")])
def test_a_request_failing_in_preparation_gets_its_own_error(http, prompt, status, kind):
    for _ in range(3):  # again and again: nothing leaks, nothing dies
        response = complete(http, prompt)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["type"] == kind and "injected failure" in error["message"]
        if status == 500:
            assert error["code"] == "request_failed" and "RuntimeError" in error["message"]
        assert_still_serving(http)


def test_a_failing_stream_ends_in_band_while_another_streams_on(server, http):
    reader = StreamReader(server.url, max_tokens=200)
    assert wait_for(lambda: len(reader.chunks) >= 2, timeout=60)
    with http.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": BROKEN, "max_tokens": 4, "stream": True}) as response:
        assert response.status_code == 200  # the headers go before the request runs
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_failed", events
    reader.join(120)
    assert reader.done and reader.finish_reason == "length"
    assert_still_serving(http)


def test_the_largest_seed_with_n_2_does_not_kill_the_server(http):
    response = complete(http, "x", max_tokens=2, seed=18446744073709551615, n=2)
    if response.status_code == 400:  # (a front end may refuse seeds past int64)
        assert response.json()["error"]["param"] == "seed", response.text
    else:
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2
    assert_still_serving(http)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_a_400_naming_seed(http, seed):
    response = complete(http, "x", max_tokens=2, seed=seed)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "seed"
    assert "seed" in response.json()["error"]["message"]
    assert_still_serving(http)
