"""The OpenAI request bodies spindle understands, and the OpenAI error shape.

Field names and defaults follow the OpenAI API (plus the usual extensions of
OpenAI-compatible servers: top_k, min_p, repetition_penalty, ignore_eos, ...).
Unknown fields are ignored, as OpenAI-compatible servers commonly do, so newer
clients keep working; known fields whose feature spindle lacks are refused with
400 rather than silently ignored.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spindle.engine.pause import EngineUnavailableError, SleepModeUnavailableError
from spindle.outputs import RequestFailedError
from spindle.sampling_params import SamplingParams

MAX_LOGPROBS = 20


class APIError(Exception):
    """An error to send to the client as {"error": {...}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 500: "server_error",
             501: "not_implemented_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def api_error(exc: BaseException) -> APIError:
    """The client-facing form of an exception raised while serving a request."""
    from spindle.engine.async_llm import EngineDeadError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, SleepModeUnavailableError):
        return APIError(501, str(exc), code="sleep_mode_unavailable")
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    if isinstance(exc, RequestFailedError):  # this request failed alone; the engine serves on
        if exc.bad_request:
            return APIError(400, str(exc), param=param_of(str(exc)))
        return APIError(500, str(exc), code="request_failed")
    if isinstance(exc, ValueError):  # the engine's and SamplingParams' validation
        return APIError(400, str(exc), param=param_of(str(exc)))
    return APIError(500, f"internal error: {exc!r}")


def param_of(message: str) -> str | None:
    """The request field a SamplingParams error names ("SamplingParams.top_p must ...")."""
    found = re.search(r"SamplingParams\.(\w+)", message)
    return found.group(1) if found else None


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields completions and chat share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field for a bad value (answered with 400)."""
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}",
                              "logprobs")
        values = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs)
        # None means "not given": SamplingParams' own default applies.
        values = {k: v for k, v in values.items() if v is not None}
        return SamplingParams(max_tokens=max_tokens, **values)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (only best_of == n)", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which spindle does not "
                              "compute", "echo")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token list each."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        return prompts


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The message as a chat template reads it (text parts joined; "developer"
        is the newer name of "system")."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported", "tool_choice")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported",
                              "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
