"""Pooling (embedding) requests on their way out: one core request each, and one
EmbeddingRequestOutput when it finishes. No detokenization, no n > 1 samples."""

from __future__ import annotations

from dataclasses import dataclass

from spindle.outputs import EmbeddingOutput, EmbeddingRequestOutput
from spindle.step_messages import EngineCoreOutput


@dataclass
class _PoolingRequest:
    prompt: str | None
    prompt_token_ids: list[int]


class PoolingOutputs:
    """Invariant: a request is tracked from add() until its output is returned once
    (by finish() or abort()); the core request id is the user's request id."""

    def __init__(self) -> None:
        self._requests: dict[str, _PoolingRequest] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __bool__(self) -> bool:
        return bool(self._requests)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self._requests[request_id] = _PoolingRequest(prompt, list(prompt_token_ids))

    def finish(self, out: EngineCoreOutput) -> EmbeddingRequestOutput | None:
        """The final output for a core output of a tracked request (None if it did not
        finish it)."""
        if not out.finished:
            return None
        request = self._requests.pop(out.req_id)
        embedding = EmbeddingOutput(out.pooled_output) if out.pooled_output is not None else None
        return EmbeddingRequestOutput(
            request_id=out.req_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, outputs=embedding,
            finish_reason=out.finish_reason if embedding is None else "stop", error=out.error)

    def abort(self, request_id: str) -> EmbeddingRequestOutput | None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        return EmbeddingRequestOutput(request_id=request_id, prompt=request.prompt,
                                      prompt_token_ids=request.prompt_token_ids, outputs=None,
                                      finish_reason="abort")
