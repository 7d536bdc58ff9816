"""Starting OpenAI servers for tests: a real `spindle serve` subprocess, or the app
in a background thread of the test process. Both listen on 127.0.0.1 on a port the
OS picks at run time."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

_READY = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)")


def served(tmp_path_factory: Any, model: str, *args: str,
           **kwargs: Any) -> Iterator["RemoteServer"]:
    """A module fixture's body: `spindle serve model *args` (RemoteServer's keywords
    too), logging to a fresh folder, yielded, then stopped, which must exit 0."""
    srv = RemoteServer(model, *args, log_path=tmp_path_factory.mktemp("serve") / "server.log",
                       **kwargs)
    yield srv
    assert srv.stop() == 0, srv.log()


def official_client(server: Any, api_key: str = "unused", **kwargs: Any) -> Any:
    """The official openai client of server's /v1 routes, without retries (a failure
    shows at once) and with a 60 s timeout."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0,
                         timeout=60, **kwargs)


class RemoteServer:
    """`python -m spindle.entrypoints.cli serve MODEL [MODEL ...] --host 127.0.0.1 --port 0
    ...`."""

    def __init__(self, model: str | list[str], *args: str, log_path: Path,
                 env: dict[str, str] | None = None, startup_timeout: float = 120.0) -> None:
        models = [model] if isinstance(model, str) else model  # (several: a model pool)
        cmd = [sys.executable, "-m", "spindle.entrypoints.cli", "serve", *models,
               "--host", "127.0.0.1", "--port", "0", *args]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            self.url = f"http://127.0.0.1:{self._wait_for_port(startup_timeout)}"
        except BaseException:
            self.stop()
            raise

    def _wait_for_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = _READY.search(self.log_path.read_text())
            if found:
                return int(found.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        raise TimeoutError(f"the server did not start within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-5000:]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class ThreadedServer:
    """The app served by uvicorn in a daemon thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve([sock])),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the threaded server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class StreamReader(threading.Thread):
    """Streams one completion in the background, keeping every chunk it gets (and
    the error object of an in-band error event, such as an aborted request's)."""

    def __init__(self, url: str, max_tokens: int, prompt: str = "Hello there",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.prompt = url, max_tokens, prompt
        self.headers = headers or {}
        self.chunks: list[dict] = []
        self.error: dict | None = None
        self.done = False
        self.start()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": self.prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as c, c.stream("POST", f"{self.url}/v1/completions",
                                                       json=body, headers=self.headers) as response:
            for event in sse_events(response):
                if event == "[DONE]":
                    self.done = True
                elif "error" in event:
                    self.error = event["error"]
                else:
                    self.chunks.append(event)

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["text"] for c in self.chunks)

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1]["choices"][0]["finish_reason"] if self.chunks else None


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """The JSON payloads of a server-sent-event stream, then "[DONE]"."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text page (0 if it is absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
