"""SIGTERM on a real `spindle serve`: it stops accepting, lets short requests
finish, aborts the ones still running when the grace period ends (their clients
get an error event with code "request_aborted"), leaves no worker process behind
and exits 0."""

from __future__ import annotations

import json
import shutil
import signal
import time

import httpx
import psutil
import pytest

from server_utils import RemoteServer, StreamReader, wait_for

GRACE = 3.0
# Long enough that a request with no end cannot finish within the grace period,
# however fast this machine generates.
MAX_MODEL_LEN = 65536


@pytest.fixture(scope="module")
def long_context_model(tiny_model, tmp_path_factory):
    """The tiny checkpoint with a longer position limit (rotary weights do not depend on it)."""
    src = tiny_model(arch="llama")
    out = tmp_path_factory.mktemp("long-context")
    for f in src.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    (out / "config.json").write_text(json.dumps(config))
    return out


def _gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _backend_flags(backend: str) -> tuple[str, ...]:
    from spindle.executor.abstract import _BACKENDS

    if backend not in _BACKENDS:
        pytest.skip(f"the {backend!r} executor is not in this build")
    if backend == "uni":
        return ()
    return ("--distributed-executor-backend", backend, "--tensor-parallel-size", "2")


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_sigterm_finishes_or_aborts_in_flight_requests_and_exits_0(long_context_model, tmp_path,
                                                                   backend):
    flags = _backend_flags(backend)
    server = RemoteServer(str(long_context_model), "--device", "cpu", "--dtype", "float32",
                          "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny",
                          "--kv-cache-memory-bytes", str(64 * 2**20),
                          "--shutdown-timeout", str(GRACE), *flags,
                          log_path=tmp_path / "server.log")
    try:
        workers = psutil.Process(server.proc.pid).children(recursive=True)
        endless = StreamReader(server.url, MAX_MODEL_LEN - 48)  # outlives the grace period
        short = StreamReader(server.url, 30, prompt="Short one")
        # Both in flight before the signal (the short one had not always connected yet
        # on a loaded 2-core machine: refused once the server stopped listening).
        assert wait_for(lambda: endless.chunks and short.chunks, timeout=30), server.log()

        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(f"{server.url}/health", timeout=5)
        assert server.proc.wait(GRACE + 15) == 0, server.log()
        elapsed = time.monotonic() - start
    finally:
        server.stop()

    assert elapsed < GRACE + 5, f"exit took {elapsed:.1f}s\n{server.log()}"
    short.join(10)
    assert short.done and short.finish_reason == "length"
    endless.join(10)
    # Aborted: an in-band error event ends the stream (the OpenAI API has no "abort").
    assert endless.done and endless.error["code"] == "request_aborted", server.log()
    assert len(endless.chunks) > 1
    assert wait_for(lambda: all(_gone(w) for w in workers), timeout=10), workers
    assert "grace period over" in server.log()
