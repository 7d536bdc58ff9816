"""Routes of a server of several models (a ModelPool): each model's health, and, in
dev mode only (SPINDLE_SERVER_DEV_MODE=1), putting one model to sleep, waking it,
and restarting it. As with the other dev routes, POST parameters come as a JSON
body, and with --api-key these need the key."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from spindle.engine.model_pool import ModelPool
from spindle.entrypoints.openai.dev_routes import _ControlBody, _json_body
from spindle.entrypoints.openai.protocol import APIError, api_error
from spindle.entrypoints.openai.serving_base import model_not_found

model_health_router = APIRouter()
router = APIRouter(tags=["dev"])


def _pool_and_name(request: Request, name: str) -> ModelPool:
    pool: ModelPool = request.app.state.pool
    if name not in pool.names:
        raise model_not_found(name, pool.names)
    return pool


@model_health_router.get("/health/{name:path}")
async def model_health(name: str, request: Request) -> Response:
    """200 when the model can serve, else 503 with the reason."""
    pool = _pool_and_name(request, name)
    try:
        await pool.check_health(name)
    except Exception as e:
        error = api_error(e)
        return JSONResponse(APIError(503, error.message, code="unhealthy").body(),
                            status_code=503)
    return JSONResponse({"healthy": True, "state": pool.model_status(name)["state"]})


class ModelSleepBody(_ControlBody):
    level: Literal[1, 2] | None = None  # None: the model's configured level


@router.post("/models/{name}/sleep")
async def sleep_model(name: str, request: Request) -> dict[str, Any]:
    """{"level": 1|2} (none: the model's sleep level): put an awake model to sleep now;
    its requests in flight freeze and go on when it wakes. Not awake: 400."""
    return await _control(request, name, ModelSleepBody,
                          lambda pool, body: pool.sleep(name, body.level))


@router.post("/models/{name}/wake_up")
async def wake_model(name: str, request: Request) -> dict[str, Any]:
    """Wake a model now (others go to sleep as the pool's limits require)."""
    return await _control(request, name, _ControlBody, lambda pool, _: pool.wake_up(name))


@router.post("/models/{name}/restart")
async def restart_model(name: str, request: Request) -> dict[str, Any]:
    """A fresh engine for the model (after a failure); returns once it is awake."""
    return await _control(request, name, _ControlBody, lambda pool, _: pool.restart(name))


async def _control(request: Request, name: str, body_model: type[_ControlBody],
                   act: Callable[[ModelPool, Any], Awaitable[None]]) -> dict[str, Any]:
    """Check the model and the body, act, then answer with the model's status."""
    pool = _pool_and_name(request, name)
    await act(pool, await _json_body(request, body_model))
    return pool.model_status(name)
