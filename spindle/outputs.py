"""What a user gets back from generate(): one RequestOutput per prompt; and how a
request that failed alone is reported (RequestFailure, RequestFailedError)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestFailure:
    """Why one request failed while the engine kept serving (say, its preparation in
    the model runner raised). bad_request: the request's own values were refused (a
    ValueError, TypeError or OverflowError), as opposed to a fault of the engine."""

    message: str
    bad_request: bool

    @classmethod
    def from_exception(cls, error: BaseException) -> "RequestFailure":
        bad = isinstance(error, (ValueError, TypeError, OverflowError))
        return cls(str(error) if bad else f"{type(error).__name__}: {error}", bad)


class RequestFailedError(RuntimeError):
    """One request failed alone; the engine serves on. LLM.generate / embed raise it
    (the other requests of that call are aborted); an AsyncLLM stream raises it
    instead of yielding the request's final output."""

    def __init__(self, request_id: str, failure: RequestFailure,
                 prompt_index: int | None = None) -> None:
        which = f"request {request_id!r}"
        if prompt_index is not None:
            which += f" (prompt {prompt_index} of the call)"
        super().__init__(f"{which} failed: {failure.message}")
        self.request_id = request_id
        self.prompt_index = prompt_index
        self.failure = failure

    @property
    def bad_request(self) -> bool:
        return self.failure.bad_request


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Set when the request failed alone (finished, its samples' finish_reason "error").
    error: RequestFailure | None = None
    # The weights these tokens came from: 0 for the checkpoint's, then what
    # update_weights() set (its version, or the number of updates so far).
    weight_version: int | str = 0
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first, then
    # its logprob and rank (and the top k) given the tokens before it. Set from the
    # output that carries the first generated token on.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Of the prompt's tokens, those the prefix cache served (its first sample's).
    num_cached_tokens: int | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What embed() returns per prompt: one pooled vector (None if it was aborted)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool = True
    finish_reason: str | None = "stop"  # "stop" | "abort" | "error"
    error: RequestFailure | None = None  # set when the request failed alone
    weight_version: int | str = 0  # the weights that embedded it (see RequestOutput)


def finite_logprob(value: float | None) -> float | None:
    """A logprob as JSON can carry it: -inf (a token the sampler filtered out) clamped
    to -9999, as OpenAI servers do; None stays None, and NaN becomes None."""
    if value is None or math.isnan(value):
        return None
    return max(value, -9999.0)
