"""Control routes for development and weight-update loops: sleep / wake_up, pause /
resume, update_weights / init_weight_transfer / receive_weights / weight_version,
collective_rpc.

Mounted only when SPINDLE_SERVER_DEV_MODE=1 (see api_server.build_app): they stop
serving and run worker methods by name, so they must never face untrusted
clients (with --api-key they need the key, as /v1 routes do). The POST routes take
their parameters as a JSON body only. Each route is a thin call into AsyncLLM; the
state lives in the engine.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel, ConfigDict, ValidationError

from spindle.engine.async_llm import AsyncLLM
from spindle.engine.pause import PauseMode
from spindle.entrypoints.openai.protocol import APIError, bad_request, invalid_request

router = APIRouter(tags=["dev"])
_Body = TypeVar("_Body", bound=BaseModel)
_Mode = Literal["abort", "wait", "keep"]


def _engine(request: Request) -> AsyncLLM:
    return request.app.state.engine


class _ControlBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


async def _json_body(request: Request, model: type[_Body]) -> _Body:
    """The route's parameters, from a JSON object body (empty: all defaults).

    Only Content-Type: application/json is accepted: a web page can send a form or
    text/plain POST to any address without asking (a "simple" cross-origin request),
    but a JSON one needs a CORS preflight this server does not grant by default.
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"{request.url.path} takes a JSON body: send the header "
                       "'Content-Type: application/json' (got "
                       f"{media_type or 'no Content-Type'})", code="unsupported_media_type")
    if request.query_params:
        raise bad_request(f"{request.url.path} takes its parameters in the JSON body, not the "
                          f"query string (got {', '.join(sorted(request.query_params))})")
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise invalid_request(e.errors()) from None


class SleepBody(_ControlBody):
    level: int = 1
    mode: _Mode = PauseMode.KEEP.value  # for requests in flight: keep, wait, abort


@router.post("/sleep")
async def sleep(request: Request) -> dict[str, Any]:
    """{"level": 0|1|2, "mode": "keep"|"wait"|"abort"}."""
    body = await _json_body(request, SleepBody)
    mode = PauseMode.parse(body.mode)
    await _engine(request).sleep(body.level, mode)
    return {"is_sleeping": True, "level": body.level, "mode": mode.value}


@router.get("/sleep_state")
async def sleep_state(request: Request) -> dict[str, Any]:
    """Level, tags asleep and, per worker, device and host bytes by tag."""
    return await _engine(request).call(lambda engine: engine.core.sleep_state())


class WakeUpBody(_ControlBody):
    tags: list[str] | None = None  # None: everything that sleeps


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, Any]:
    """{"tags": ["weights", "kv_cache", "scheduling"]} (any of them; none: all)."""
    body = await _json_body(request, WakeUpBody)
    engine = _engine(request)
    await engine.wake_up(body.tags)
    return {"is_sleeping": await engine.is_sleeping()}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return {"is_sleeping": await _engine(request).is_sleeping()}


class PauseBody(_ControlBody):
    mode: _Mode = PauseMode.ABORT.value


@router.post("/pause")
async def pause(request: Request) -> dict[str, Any]:
    """{"mode": "abort"|"wait"|"keep"}. Returns once the pause holds (for mode
    wait: once in-flight requests finished)."""
    body = await _json_body(request, PauseBody)
    mode = PauseMode.parse(body.mode)
    await _engine(request).pause(mode)
    return {"is_paused": True, "mode": mode.value}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    await _json_body(request, _ControlBody)
    await _engine(request).resume()
    return {"is_paused": False}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    mode = await _engine(request).is_paused()
    return {"is_paused": mode is not None, "mode": mode.value if mode else None}


class UpdateWeightsBody(_ControlBody):
    path: str  # a checkpoint directory the server's workers can read
    version: int | str | None = None  # None: the number of updates so far
    mode: _Mode = PauseMode.WAIT.value  # for requests in flight: wait, keep, abort


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """{"path": DIR, "version": ..., "mode": "wait"|"keep"|"abort"}: load the
    checkpoint's weights into the running engine (checked whole first: a bad one
    changes nothing and answers 400). Responses from then on carry the version."""
    body = await _json_body(request, UpdateWeightsBody)
    engine = _engine(request)
    try:
        await engine.update_weights(body.path, body.version, PauseMode.parse(body.mode))
    except ValueError as e:
        raise bad_request(str(e), "path") from e
    return {"weight_version": await engine.call(lambda e: e.weight_version)}


class InitWeightTransferBody(_ControlBody):
    address: str  # the trainer's WeightSender.address, HOST:PORT
    timeout_s: float = 300.0


@router.post("/init_weight_transfer")
async def init_weight_transfer(request: Request) -> dict[str, Any]:
    """{"address": "HOST:PORT"}: join a trainer's spindle.rl.WeightSender; returns once
    connected (the trainer calls sender.connect() meanwhile)."""
    body = await _json_body(request, InitWeightTransferBody)
    try:
        await _engine(request).init_weight_transfer(body.address, body.timeout_s)
    except ValueError as e:
        raise bad_request(str(e), "address") from e
    return {"connected": True}


class ReceiveWeightsBody(_ControlBody):
    version: int | str | None = None
    mode: _Mode = PauseMode.WAIT.value


@router.post("/receive_weights")
async def receive_weights(request: Request) -> dict[str, Any]:
    """{"version": ..., "mode": ...}: load what the trainer's next sender.send() sends
    (a list that does not fit answers 400 and changes nothing)."""
    body = await _json_body(request, ReceiveWeightsBody)
    engine = _engine(request)
    try:
        await engine.receive_weights(body.version, PauseMode.parse(body.mode))
    except ValueError as e:
        raise bad_request(str(e)) from e
    return {"weight_version": await engine.call(lambda e: e.weight_version)}


@router.get("/weight_version")
async def weight_version(request: Request) -> dict[str, Any]:
    """The version of the weights responses come from now (0: the checkpoint's)."""
    return {"weight_version": await _engine(request).call(lambda e: e.weight_version)}


class CollectiveRPCRequest(_ControlBody):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> dict[str, Any]:
    """Run a public worker method on every worker; their replies, as JSON."""
    body = await _json_body(request, CollectiveRPCRequest)
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
