"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added to and
removed from a running server's names (--allow-runtime-lora-updating; vLLM's routes).

A loaded adapter is read (checked) before its name is served; requests then name it
as their model. Unloading takes the name away: requests in flight with it finish, and
its device slot is reused when another adapter needs one. A name loaded again gets a
new id (and its new files)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from spindle.entrypoints.openai.dev_routes import _json_body
from spindle.entrypoints.openai.protocol import APIError, bad_request

router = APIRouter(tags=["lora"])


class LoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    from spindle.lora.adapter import load_peft_adapter

    body = await _json_body(request, LoadBody)
    models = request.app.state.models
    if body.lora_name in models.all_names:
        raise bad_request(f"the name {body.lora_name!r} is served already", "lora_name")
    rank = request.app.state.engine.config.lora.max_lora_rank
    try:  # (file reads: off the event loop)
        await asyncio.to_thread(load_peft_adapter, body.lora_path, rank)
    except ValueError as e:
        raise bad_request(str(e), "lora_path") from None
    if body.lora_name in models.all_names:  # (loaded meanwhile by another request)
        raise bad_request(f"the name {body.lora_name!r} is served already", "lora_name")
    models.adapters.add(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = await _json_body(request, UnloadBody)
    models = request.app.state.models
    if models.adapter(body.lora_name) is None:
        raise APIError(404, f"no LoRA adapter is served as {body.lora_name!r}",
                       param="lora_name", code="model_not_found")
    models.adapters.remove(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
