"""Control routes for development and weight-update loops: sleep / wake_up, pause /
resume, collective_rpc.

Mounted only when SPINDLE_SERVER_DEV_MODE=1 (see api_server.build_app): they stop
serving and run worker methods by name, so they must never face untrusted
clients. Each route is a thin call into AsyncLLM; the state lives in the engine.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel

from spindle.engine.async_llm import AsyncLLM
from spindle.engine.pause import PauseMode
from spindle.entrypoints.openai.protocol import bad_request

router = APIRouter(tags=["dev"])


def _engine(request: Request) -> AsyncLLM:
    return request.app.state.engine


@router.post("/sleep")
async def sleep(request: Request, level: int = 1,
                mode: str = PauseMode.KEEP.value) -> dict[str, Any]:
    """mode, for requests in flight: keep (continue after wake_up), wait, abort."""
    mode = PauseMode.parse(mode)  # ValueError -> 400 naming the allowed modes
    await _engine(request).sleep(level, mode)
    return {"is_sleeping": True, "level": level, "mode": mode.value}


@router.get("/sleep_state")
async def sleep_state(request: Request) -> dict[str, Any]:
    """Level, tags asleep and, per worker, device and host bytes by tag."""
    return await _engine(request).call(lambda engine: engine.core.sleep_state())


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> dict[str, Any]:
    engine = _engine(request)
    await engine.wake_up(tags)
    return {"is_sleeping": await engine.is_sleeping()}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return {"is_sleeping": await _engine(request).is_sleeping()}


@router.post("/pause")
async def pause(request: Request, mode: str = PauseMode.ABORT.value) -> dict[str, Any]:
    """Returns once the pause holds (for mode=wait: once in-flight requests finished)."""
    mode = PauseMode.parse(mode)
    await _engine(request).pause(mode)
    return {"is_paused": True, "mode": mode.value}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    await _engine(request).resume()
    return {"is_paused": False}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    mode = await _engine(request).is_paused()
    return {"is_paused": mode is not None, "mode": mode.value if mode else None}


class CollectiveRPCRequest(BaseModel):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


@router.post("/collective_rpc")
async def collective_rpc(body: CollectiveRPCRequest, request: Request) -> dict[str, Any]:
    """Run a public worker method on every worker; their replies, as JSON."""
    if not body.method.isidentifier() or body.method.startswith("_"):
        raise bad_request(f"method must name a public worker method, got {body.method!r}",
                          "method")
    try:
        results = await _engine(request).collective_rpc(body.method, body.args, body.kwargs,
                                                        body.timeout)
    except AttributeError as e:
        raise bad_request(f"the workers have no method {body.method!r}: {e}", "method") from e
    return {"results": [_jsonable(r) for r in results]}


def _jsonable(value: Any) -> Any:
    """Dataclasses, dicts, lists, enums as JSON; anything else as its repr."""
    try:
        return jsonable_encoder(value)
    except Exception:
        return repr(value)
