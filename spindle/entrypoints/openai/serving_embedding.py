"""POST /v1/embeddings: texts (or token ids) in, one embedding each out, in the
OpenAI shape. Served by engines started with task="embed"; the app mounts this
router through add_embedding_routes()."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from spindle.entrypoints.openai.protocol import (APIError, Text, _Request, bad_request,
                                                 request_aborted)
from spindle.entrypoints.openai.serving_base import OpenAIServing, final_outputs
from spindle.outputs import EmbeddingRequestOutput
from spindle.pooling_params import PoolingParams

router = APIRouter()


class EmbeddingRequest(_Request):
    input: Text | list[Text] | list[int] | list[list[int]]
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None

    def inputs(self) -> list[str | list[int]]:
        """One string or token list per embedding asked for."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        if not value:
            raise bad_request("input must not be empty", "input")
        return list(value)


class EmbeddingServing(OpenAIServing):
    async def create(self, req: EmbeddingRequest, request_id: str) -> dict[str, Any]:
        model = self.models.resolve(req.model)
        if self.engine.config.model.task != "embed":
            raise bad_request(f"the model {model!r} does not serve embeddings (start the server "
                              "with --task embed and an embedding model)", "model")
        if req.dimensions is not None:
            raise bad_request("dimensions is not supported", "dimensions")
        streams = await self.start(request_id, req.inputs(), PoolingParams())
        outputs: list[EmbeddingRequestOutput] = await final_outputs(streams)
        data = [_embedding_item(i, out, req.encoding_format) for i, out in enumerate(outputs)]
        num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    from spindle.entrypoints.openai.api_server import serve_request

    return await serve_request(request, "embd", "input", lambda request_id:
                               request.app.state.routes.route(body.model).embeddings.create(
                                   body, request_id))


def _embedding_item(index: int, output: EmbeddingRequestOutput, encoding: str) -> dict[str, Any]:
    if output.finish_reason == "abort":
        raise request_aborted()
    if output.outputs is None:
        raise APIError(500, f"embedding request {output.request_id} ended without a result "
                       f"({output.finish_reason})")
    vector: Any = output.outputs.embedding
    if encoding == "base64":  # little-endian float32, as OpenAI clients decode it
        vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return {"object": "embedding", "index": index, "embedding": vector}
