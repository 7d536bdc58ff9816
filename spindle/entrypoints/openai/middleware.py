"""The OpenAI server's ASGI middleware: the API key, the request body limit, and the
boundary that answers an unexpected exception with a 500 instead of dropping the
connection. Each answers in the OpenAI error shape, without reading a body it refuses.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException as StarletteHTTPException

from spindle.entrypoints.openai.protocol import APIError

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Open without the API key: what load balancers and monitoring poll.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


async def send_error(send: Send, error: APIError,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer with error as JSON. ASCII-escaped, so any text in a message is safe."""
    body = json.dumps(error.body()).encode("ascii")
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode("ascii")),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class APIKeyMiddleware:
    """Every route but OPEN_PATHS needs `Authorization: Bearer KEY` (compared in
    constant time); anything else gets 401 before the request is routed."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization")
        if given is not None and self._matches(given):
            return await self.app(scope, receive, send)
        message = ("missing API key: send the header 'Authorization: Bearer KEY'" if given is None
                   else "incorrect API key")
        await send_error(send, APIError(401, message, code="invalid_api_key"),
                         [(b"www-authenticate", b"Bearer")])

    def _matches(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        # compare_digest runs in time independent of where the tokens differ.
        return hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"


class RequestBodyTooLarge(StarletteHTTPException):
    """Raised from receive() once a body grows past the limit: the framework passes
    HTTPExceptions from body reading through to the error handlers."""

    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large_message(limit))


def _too_large_message(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit} bytes "
            "(--max-request-body-bytes)")


class BodyLimitMiddleware:
    """Refuses a body over max_bytes with 413: at once when its Content-Length says so
    (nothing is read), else as soon as the bytes received pass the limit (chunked
    bodies, or a Content-Length that lies)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, APIError(413, _too_large_message(self.max_bytes),
                                                   code="request_too_large"))
        received = 0

        async def counting_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestBodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


class ErrorBoundary:
    """An exception that escapes the app before its response started is logged with
    its traceback and answered with a 500 in the OpenAI shape. (Left to the server, it
    would also close the connection, taking the client's keep-alive with it.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise  # half an answer is out: only closing the connection can end it
            logger.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=exc)
            await send_error(send, APIError(500, f"internal error: {exc!r}"))
