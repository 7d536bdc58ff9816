"""The OpenAI-compatible HTTP server: a FastAPI app around an AsyncLLM, and
run_server(), which `spindle serve` calls.

build_app() knows nothing of sockets or signals, so tests can mount it anywhere.
Around the routes sit, outermost first: CORS (only with allowed origins), the API
key (only with one), the request body limit, and the error boundary
(middleware.py). run_server() owns the engine, the listening socket and the
graceful shutdown on SIGINT / SIGTERM: stop accepting, let requests in flight
finish for a grace period, abort the rest (their clients get an error with code
"request_aborted"), stop the workers, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from spindle import __version__
from spindle.config import EngineArgs, ServerArgs
from spindle.engine.async_llm import AsyncLLM
from spindle.engine.stats import LoggingStatLogger
from spindle.entrypoints.openai.metrics import CONTENT_TYPE, PrometheusStatLogger
from spindle.entrypoints.openai.middleware import (APIKeyMiddleware, BodyLimitMiddleware,
                                                   ErrorBoundary)
from spindle.entrypoints.openai.protocol import (APIError, ChatCompletionRequest,
                                                 CompletionRequest, api_error, invalid_request)
from spindle.entrypoints.openai.serving_base import RequestIds, ServedModels
from spindle.entrypoints.openai.serving_chat import ChatServing
from spindle.entrypoints.openai.serving_completion import CompletionServing

logger = logging.getLogger(__name__)

DEV_MODE_ENV = "SPINDLE_SERVER_DEV_MODE"
router = APIRouter()


def build_app(engine: AsyncLLM, served_model_names: Sequence[str] | None = None,
              dev_mode: bool | None = None, server_args: ServerArgs | None = None) -> FastAPI:
    """The app serving engine. dev_mode None reads SPINDLE_SERVER_DEV_MODE=1;
    server_args None: ServerArgs() (no API key, CORS off, the default body limit)."""
    server_args = server_args or ServerArgs()
    model_config = engine.config.model
    models = ServedModels(names=tuple(served_model_names or [model_config.model]),
                          root=model_config.model, max_model_len=model_config.max_model_len)
    metrics = PrometheusStatLogger(models.names[0])
    stats_log = LoggingStatLogger()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.add_stat_logger(metrics)
        engine.add_stat_logger(stats_log)
        try:
            yield
        finally:
            engine.remove_stat_logger(metrics)
            engine.remove_stat_logger(stats_log)

    app = FastAPI(title="spindle", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.models = models
    app.state.metrics = metrics
    app.state.completions = CompletionServing(engine, models)
    app.state.chat = ChatServing(engine, models)
    app.state.request_ids = RequestIds()
    from spindle.entrypoints.openai.serving_embedding import add_embedding_routes

    add_embedding_routes(app, engine, models)  # POST /v1/embeddings (task="embed")
    _add_error_handlers(app)
    app.include_router(router)
    if dev_mode is None:
        dev_mode = os.environ.get(DEV_MODE_ENV, "") == "1"
    if dev_mode:
        from spindle.entrypoints.openai.dev_routes import router as dev_router

        app.include_router(dev_router)
        logger.warning("%s=1: the control routes (/sleep, /wake_up, /pause, /resume, "
                       "/collective_rpc) are mounted; never expose this server to untrusted "
                       "clients", DEV_MODE_ENV)
    _add_middleware(app, server_args)
    return app


def _add_middleware(app: FastAPI, args: ServerArgs) -> None:
    # Each add wraps the ones before it: the last added sees a request first.
    app.add_middleware(ErrorBoundary)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    if args.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    if args.allowed_origins:  # outermost: preflights and 401s get their CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_methods=args.allowed_methods or ["*"],
                           allow_headers=args.allowed_headers or ["*"],
                           allow_credentials=args.allow_credentials)


# ---- routes ---------------------------------------------------------------------------
@router.get("/health")
async def health(request: Request) -> Response:
    try:
        await request.app.state.engine.check_health()
    except Exception as e:
        return error_response(APIError(503, f"the engine is not healthy: {e}", code="unhealthy"))
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return request.app.state.models.listing()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    return request.app.state.models.retrieve(model_id)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await serve_request(request, "cmpl", "prompt", lambda request_id:
                               request.app.state.completions.create(body, request_id))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await serve_request(request, "chatcmpl", "messages", lambda request_id:
                               request.app.state.chat.create(body, request_id))


async def serve_request(request: Request, prefix: str, prompt_param: str,
                        create: Callable[[str], Awaitable[Any]]) -> Response:
    """Run create(request_id) and answer: JSON for a finished body, server-sent events
    for a stream, an error otherwise; every answer carries the X-Request-Id header.

    The id is the client's X-Request-Id when it sends one (so logs on both sides
    agree), held while the request is in flight. A client that disconnects before
    a whole (non-streamed) answer is ready cancels the work, which aborts its
    requests in the engine; a stream is cancelled the same way by the framework
    when its client goes. prompt_param: the field a too-long prompt is named by.
    """
    request_id = request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": request_id}
    ids: RequestIds = request.app.state.request_ids
    try:
        ids.claim(request_id)
    except APIError as e:
        return error_response(e, headers)
    streaming = False
    try:
        result = await _unless_disconnected(request, create(request_id))
        if result is None:
            return Response(status_code=499, headers=headers)  # nobody is listening
        if isinstance(result, dict):
            return JSONResponse(result, headers=headers)
        streaming = True
        return _EventStream(result, headers, on_close=lambda: ids.release(request_id))
    except Exception as exc:
        return error_response(_logged(api_error(exc, prompt_param), request, exc), headers)
    finally:
        if not streaming:
            ids.release(request_id)


class _EventStream(StreamingResponse):
    """Server-sent events; on_close() runs once the response ends, however it ends
    (also when the stream never started)."""

    def __init__(self, events: Any, headers: dict[str, str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """work's result, or None if the client disconnected first (work is cancelled)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        task.cancel()  # a no-op once it is done
    return task.result() if task in done else None


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- errors -----------------------------------------------------------------------------
def error_response(error: APIError, headers: dict[str, str] | None = None) -> Response:
    # ASCII-escaped JSON: a message quoting the client's text is always encodable.
    return Response(json.dumps(error.body()), status_code=error.status, headers=headers,
                    media_type="application/json")


def _logged(error: APIError, request: Request, exc: BaseException) -> APIError:
    """error; logged with the traceback when it is the server's fault (not a 503)."""
    if error.status >= 500 and error.status != 503:
        logger.error("request %s failed: %s", request.url.path, error.message, exc_info=exc)
    return error


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in the OpenAI shape. Expected failures (bad input, a paused
    engine) are answered without a traceback; anything else is a 500 and logged (by
    the ErrorBoundary middleware for kinds not named here)."""

    async def from_exception(request: Request, exc: Exception) -> Response:
        return error_response(_logged(api_error(exc), request, exc))

    async def from_validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(invalid_request(exc.errors()))

    async def from_http(request: Request, exc: StarletteHTTPException) -> Response:
        error = APIError(exc.status_code, str(exc.detail), code=getattr(exc, "code", None))
        return error_response(error, exc.headers)

    app.add_exception_handler(RequestValidationError, from_validation)
    app.add_exception_handler(StarletteHTTPException, from_http)
    for kind in (APIError, ValueError, RuntimeError):
        app.add_exception_handler(kind, from_exception)


# ---- running it -------------------------------------------------------------------------
def run_server(engine_args: EngineArgs, host: str = "127.0.0.1", port: int = 8000,
               served_model_names: Sequence[str] | None = None,
               shutdown_timeout: float = 30.0, server_args: ServerArgs | None = None) -> int:
    """Serve until SIGINT / SIGTERM, then shut down gracefully; returns the exit code."""
    server_args = server_args or ServerArgs()
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        app = build_app(engine, served_model_names or [engine_args.model],
                        server_args=server_args)
        sock = _bind(host, port)
        config = uvicorn.Config(app, log_level="info",
                                timeout_graceful_shutdown=max(shutdown_timeout, 0) + 5)
        server = _GracefulServer(config, engine, shutdown_timeout)
        bound_port = sock.getsockname()[1]
        url_host = f"[{host}]" if ":" in host else host
        logger.info("serving %s on http://%s:%d (SIGINT/SIGTERM stops, grace %.0fs)",
                    app.state.models.names[0], url_host, bound_port, shutdown_timeout)
        logger.info("API key: %s; CORS: %s; request bodies up to %d bytes",
                    "required" if server_args.api_key else "none (every client is served)",
                    ", ".join(server_args.allowed_origins or []) or "off",
                    server_args.max_request_body_bytes)
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        engine.shutdown()
    logger.info("server stopped")
    return 0


_LISTEN_BACKLOG = 2048  # (uvicorn's own default)


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 lets the OS pick a free port.

    It listens before the "serving ... on" line is logged: a client that connects as
    soon as it reads that line waits in the backlog until uvicorn accepts, instead of
    being refused."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(_LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from e
    return sock


class _GracefulServer(uvicorn.Server):
    """uvicorn's server with spindle's shutdown: after the grace period, generations
    still running are aborted (so every client gets a complete answer: an error with
    code "request_aborted"), and a stop by signal exits with status 0 (uvicorn
    re-raises the signal)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace = grace

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            logger.info("%s: no new connections; requests in flight get %.0fs to finish",
                        signal.Signals(sig).name, self.grace)
        self.handle_exit(sig, frame)  # a second SIGINT forces the exit

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort_in_flight(self) -> None:
        stats = self.engine.stats
        logger.warning("grace period over: aborting the requests still in flight (%d running, "
                       "%d waiting)", stats.num_running, stats.num_waiting + stats.num_held)
        self.engine.abort_all_nowait()
