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
from prometheus_client import CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from spindle import __version__
from spindle.config import EngineArgs, ServerArgs
from spindle.engine.async_llm import AsyncLLM
from spindle.engine.model_pool import ModelPool
from spindle.engine.stats import LoggingStatLogger
from spindle.entrypoints.openai.metrics import (CONTENT_TYPE, EngineMetricFamilies, PoolMetrics,
                                                PrometheusStatLogger)
from spindle.entrypoints.openai.middleware import (APIKeyMiddleware, BodyLimitMiddleware,
                                                   ErrorBoundary)
from spindle.entrypoints.openai.protocol import (APIError, ChatCompletionRequest,
                                                 CompletionRequest, api_error, invalid_request)
from spindle.entrypoints.openai.routing import ModelRoutes, ServedModel
from spindle.entrypoints.openai.serving_base import AdapterRegistry, RequestIds, ServedModels
from spindle.entrypoints.openai.serving_embedding import router as embedding_router
from spindle.entrypoints.openai.serving_transcription import router as transcription_router
from spindle.entrypoints.openai.tokenize_routes import router as tokenize_router
from spindle.switches import on_off

logger = logging.getLogger(__name__)

DEV_MODE_ENV = "SPINDLE_SERVER_DEV_MODE"
router = APIRouter()


def build_app(engine: AsyncLLM, served_model_names: Sequence[str] | None = None,
              dev_mode: bool | None = None, server_args: ServerArgs | None = None) -> FastAPI:
    """The app serving engine. dev_mode None reads SPINDLE_SERVER_DEV_MODE=1;
    server_args None: ServerArgs() (no API key, CORS off, the default body limit)."""
    model_config = engine.config.model
    server_args = server_args or ServerArgs()
    names = tuple(served_model_names or [model_config.model])
    models = ServedModels(names=names, root=model_config.model,
                          max_model_len=model_config.max_model_len,
                          adapters=AdapterRegistry(_served_adapters(engine, names, server_args)))
    metrics = PrometheusStatLogger(models.names[0])
    stat_loggers = [metrics, LoggingStatLogger()]

    def attach() -> None:
        for stat_logger in stat_loggers:
            engine.add_stat_logger(stat_logger)

    def detach() -> None:
        for stat_logger in stat_loggers:
            engine.remove_stat_logger(stat_logger)

    app = _make_app(ModelRoutes([ServedModel.of(engine, models, server_args or ServerArgs())]),
                    metrics.registry, attach, detach, server_args)
    app.state.engine = engine
    app.state.health = lambda: _engine_health(engine)
    if server_args.allow_runtime_lora_updating:
        if engine.config.lora is None:
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
        from spindle.entrypoints.openai.lora_routes import router as lora_router

        app.state.models = models
        app.include_router(lora_router)
    if _dev_mode(dev_mode):
        from spindle.entrypoints.openai.dev_routes import router as dev_router

        app.include_router(dev_router)
        logger.warning("%s=1: the control routes (/sleep, /wake_up, /pause, /resume, "
                       "/collective_rpc) are mounted; never expose this server to untrusted "
                       "clients", DEV_MODE_ENV)
    _add_middleware(app, server_args or ServerArgs())
    return app


def _served_adapters(engine: AsyncLLM, names: Sequence[str], server_args: ServerArgs) -> tuple:
    """--lora-modules as the adapters a server of engine answers to: refused without
    enable_lora, under a name the base model has, or where the engine cannot serve one
    (read now, so that a bad adapter stops the server before it listens)."""
    from spindle.lora.adapter import load_peft_adapter

    adapters = server_args.lora_requests()
    if not adapters:
        return ()
    if engine.config.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, adapter in adapters.items():
        if name in names:
            raise ValueError(f"--lora-modules names {name!r}, which the base model is served "
                             "as already")
        load_peft_adapter(adapter.lora_path, engine.config.lora.max_lora_rank)
    return tuple(adapters.values())


def build_pool_app(pool: ModelPool, dev_mode: bool | None = None,
                   server_args: ServerArgs | None = None) -> FastAPI:
    """The app serving every model of a started ModelPool, routed by the model field;
    /v1/models shows each model's state, /health each model's health."""
    registry = CollectorRegistry()
    families = EngineMetricFamilies(registry)
    pool_metrics = PoolMetrics(registry, pool.names)
    for status in pool.status():
        pool_metrics.set_state(status["name"], status["state"])
    served, stat_loggers = [], []
    for name in pool.names:
        config = pool.config(name).model
        served.append(ServedModel.of(pool.engine(name), ServedModels(
            names=(name,), root=config.model, max_model_len=config.max_model_len),
            server_args or ServerArgs()))
        stat_loggers += [(name, PrometheusStatLogger(name, families)),
                         (name, LoggingStatLogger(model_name=name))]

    def attach() -> None:
        pool.add_listener(pool_metrics)
        for name, stat_logger in stat_loggers:
            pool.add_stat_logger(name, stat_logger)

    def detach() -> None:
        for name, stat_logger in stat_loggers:
            pool.remove_stat_logger(name, stat_logger)

    routes = ModelRoutes(served, card_extra=lambda name: _pool_card(pool, name))
    app = _make_app(routes, registry, attach, detach, server_args)
    app.state.pool = pool
    app.state.health = lambda: _pool_health(pool)
    from spindle.entrypoints.openai.pool_routes import model_health_router

    app.include_router(model_health_router)
    if _dev_mode(dev_mode):
        from spindle.entrypoints.openai.pool_routes import router as pool_dev_router

        app.include_router(pool_dev_router)
        logger.warning("%s=1: the model control routes (/models/NAME/sleep, /wake_up, "
                       "/restart) are mounted; never expose this server to untrusted clients",
                       DEV_MODE_ENV)
    _add_middleware(app, server_args or ServerArgs())
    return app


def _make_app(routes: ModelRoutes, registry: CollectorRegistry, attach: Callable[[], None],
              detach: Callable[[], None], server_args: ServerArgs | None) -> FastAPI:
    """What both kinds of server share: the routes, the error handlers, and the stat
    loggers attached for the app's lifetime."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        attach()
        try:
            yield
        finally:
            detach()

    app = FastAPI(title="spindle", version=__version__, lifespan=lifespan)
    app.state.routes = routes
    app.state.metrics_registry = registry
    app.state.request_ids = RequestIds()
    _add_error_handlers(app)
    app.include_router(router)
    app.include_router(embedding_router)  # POST /v1/embeddings (task="embed")
    app.include_router(transcription_router)  # POST /v1/audio/* (Whisper checkpoints)
    app.include_router(tokenize_router)  # POST /tokenize, /detokenize
    return app


def _dev_mode(dev_mode: bool | None) -> bool:
    return on_off(DEV_MODE_ENV, False) if dev_mode is None else dev_mode


async def _engine_health(engine: AsyncLLM) -> Response:
    try:
        await engine.check_health()
    except Exception as e:
        return error_response(APIError(503, f"the engine is not healthy: {e}", code="unhealthy"))
    return Response(status_code=200)


async def _pool_health(pool: ModelPool) -> Response:
    """200 when every model can serve, else 503; the body says, per model."""
    report = {}
    for name in pool.names:
        try:
            await pool.check_health(name)
            report[name] = {"healthy": True, "error": None}
        except Exception as e:
            report[name] = {"healthy": False, "error": str(e)}
        report[name]["state"] = pool.model_status(name)["state"]
    healthy = all(r["healthy"] for r in report.values())
    return JSONResponse({"healthy": healthy, "models": report}, status_code=200 if healthy else 503)


def _pool_card(pool: ModelPool, name: str) -> dict[str, Any]:
    status = pool.model_status(name)
    return {key: status[key] for key in ("state", "sleep_level", "requests_in_flight",
                                         "requests_queued", "error")}


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
    return await request.app.state.health()


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return request.app.state.routes.listing()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    return request.app.state.routes.retrieve(model_id)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await serve_request(request, "cmpl", "prompt", lambda request_id:
                               request.app.state.routes.route(body.model).completions.create(
                                   body, request_id))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await serve_request(request, "chatcmpl", "messages", lambda request_id:
                               request.app.state.routes.route(body.model).chat.create(
                                   body, request_id))


async def serve_request(request: Request, prefix: str, prompt_param: str,
                        create: Callable[[str], Awaitable[Any]]) -> Response:
    """Run create(request_id) and answer: JSON for a finished body, a Response as it is
    (a text body), server-sent events for a stream, an error otherwise; every answer
    carries the X-Request-Id header.

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
        if isinstance(result, Response):
            result.headers.update(headers)
            return result
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
        _serve(app, host, port, shutdown_timeout, server_args, engine.abort_all_nowait,
               lambda: _in_flight(engine.stats))
    finally:
        engine.shutdown()
    logger.info("server stopped")
    return 0


def run_pool_server(pool: ModelPool, host: str = "127.0.0.1", port: int = 8000,
                    shutdown_timeout: float = 30.0,
                    server_args: ServerArgs | None = None) -> int:
    """run_server for a ModelPool: starts it (every model loaded), serves, shuts it down."""
    server_args = server_args or ServerArgs()
    pool.start()
    try:
        app = build_pool_app(pool, server_args=server_args)
        _serve(app, host, port, shutdown_timeout, server_args, pool.abort_all_nowait,
               lambda: ", ".join(f"{s['name']}: {s['requests_in_flight']} in flight, "
                                 f"{s['requests_queued']} queued" for s in pool.status()))
    finally:
        pool.shutdown()
    logger.info("server stopped")
    return 0


def _serve(app: FastAPI, host: str, port: int, shutdown_timeout: float,
           server_args: ServerArgs, abort_all: Callable[[], None],
           describe_in_flight: Callable[[], str]) -> None:
    sock = _bind(host, port)
    config = uvicorn.Config(app, log_level="info",
                            timeout_graceful_shutdown=max(shutdown_timeout, 0) + 5)
    server = _GracefulServer(config, shutdown_timeout, abort_all, describe_in_flight)
    bound_port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    logger.info("serving %s on http://%s:%d (SIGINT/SIGTERM stops, grace %.0fs)",
                ", ".join(app.state.routes.names), url_host, bound_port, shutdown_timeout)
    logger.info("API key: %s; CORS: %s; request bodies up to %d bytes",
                "required" if server_args.api_key else "none (every client is served)",
                ", ".join(server_args.allowed_origins or []) or "off",
                server_args.max_request_body_bytes)
    asyncio.run(server.serve(sockets=[sock]))


def _in_flight(stats) -> str:
    return f"{stats.num_running} running, {stats.num_waiting + stats.num_held} waiting"


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

    def __init__(self, config: uvicorn.Config, grace: float, abort_all: Callable[[], None],
                 describe_in_flight: Callable[[], str]) -> None:
        super().__init__(config)
        self.grace = grace
        self._abort_all = abort_all
        self._describe_in_flight = describe_in_flight

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
        logger.warning("grace period over: aborting the requests still in flight (%s)",
                       self._describe_in_flight())
        self._abort_all()
