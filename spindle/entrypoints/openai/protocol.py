"""The OpenAI request bodies spindle understands, and the OpenAI error shape.

Field names and defaults follow the OpenAI API (plus the usual extensions of
OpenAI-compatible servers: top_k, min_p, repetition_penalty, ignore_eos, ...).
Types are strict, as the OpenAI API's are: a boolean is no number, a string no
boolean, a float no integer; text must be valid Unicode (no lone surrogates, which
JSON's \\ud800 escapes can carry). Unknown fields are ignored, as OpenAI-compatible
servers commonly do, so newer clients keep working; known fields whose feature
spindle lacks are refused with 400 rather than silently ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from spindle.engine.input_processor import PromptTooLongError
from spindle.engine.pause import EngineUnavailableError, SleepModeUnavailableError
from spindle.entrypoints.beam_search import BeamSearchParams
from spindle.entrypoints.tool_calls import check_tools, forced_schema, tool_choice_of
from spindle.outputs import RequestFailedError
from spindle.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20


class APIError(Exception):
    """An error to send to the client as {"error": {...}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
             404: "invalid_request_error", 413: "invalid_request_error",
             415: "invalid_request_error", 500: "server_error",
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


def request_aborted() -> APIError:
    """What a client gets for a request the server aborted (a pause or sleep with mode
    "abort", or the end of the shutdown grace period): an error, since the OpenAI API
    has no finish reason for it."""
    return APIError(503, "the server aborted this request before it finished (the engine "
                    "was paused or put to sleep with mode abort, or the server is shutting "
                    "down); retry it later", code="request_aborted")


def api_error(exc: BaseException, prompt_param: str | None = None) -> APIError:
    """The client-facing form of an exception raised while serving a request.
    prompt_param: the request field that holds the prompt (named by a too-long one)."""
    from spindle.engine.async_llm import EngineDeadError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
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


# pydantic's labels for the branches of a union type ("str", "list[int]",
# "function-after[...]"): not field names, so left out of a field's path.
_UNION_BRANCH = re.compile(r"[\[(]|^(str|int|float|bool|none|dict|list)$")


def invalid_request(errors: Sequence[dict[str, Any]]) -> APIError:
    """400 from pydantic's validation errors: each field at fault with what is wrong
    (no input values: they may be large, or not printable); param names the first."""
    by_field: dict[str, list[tuple[str, dict[str, Any]]]] = {}  # top-level field -> errors
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "cannot be decoded")
            return bad_request(f"the body is not valid JSON: {reason}")
        path = [str(p) for p in error.get("loc", ())
                if p != "body" and not (isinstance(p, str) and _UNION_BRANCH.search(p))]
        by_field.setdefault(path[0] if path else "", []).append((".".join(path), error))
    by_path: dict[str, list[str]] = {}
    for field_errors in by_field.values():
        # A validator that ran (the type fitted) says more than the union branches
        # whose type did not fit.
        chosen = [(p, e) for p, e in field_errors if e.get("type") == "value_error"]
        for path, error in chosen or field_errors:
            message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
            messages = by_path.setdefault(path, [])
            if message not in messages:
                messages.append(message)
    parts = [f"{path or 'body'}: {' or '.join(messages)}"
             for path, messages in list(by_path.items())[:5]]
    return APIError(400, "invalid request: " + "; ".join(parts),
                    param=next(iter(by_path), None) or None)


def param_of(message: str) -> str | None:
    """The request field a validation error names: SamplingParams' ("SamplingParams.top_p
    must ...") or the chat checks' ("messages[1] has role ...")."""
    if message.startswith("messages"):
        return "messages"
    found = re.search(r"SamplingParams\.(\w+)", message)
    return found.group(1) if found else None


def _valid_unicode(text: str) -> str:
    """text, if it can be encoded as UTF-8 (the tokenizer's and the response's need)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone UTF-16 surrogate ({text[e.start]!r} at "
                         f"character {e.start}), which is not valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", **_STRICT)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields completions and chat share."""

    model: Text | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text] | None = None
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
    user: Text | None = None
    logit_bias: dict[str, float] | None = None
    # (vLLM's extension) per prompt token after the first: its logprob, plus the top k.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # (vLLM's extension) exactly one of json (a schema), regex, choice, json_object.
    structured_outputs: dict[str, Any] | None = None
    # (vLLM's extension) lower is admitted first; needs --scheduling-policy priority.
    priority: int = 0
    # (vLLM's extension) cached prefixes are shared only among requests of one salt.
    cache_salt: Text | None = Field(None, min_length=1)
    # (vLLM's extension) beam search of n beams, as transformers' generate(num_beams=n):
    # the n best sequences; length_penalty and early_stopping as transformers' are.
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        if not self.use_beam_search:
            for name in ("length_penalty", "early_stopping"):
                if getattr(self, name) is not None:
                    raise bad_request(f"{name} applies only with use_beam_search", name)

    def beam_search_params(self, max_tokens: int | None, max_n: int) -> BeamSearchParams:
        """The search use_beam_search asks for; 400 naming a field beam search cannot
        honour (it samples nothing, and streams and scores nothing but its sequences)."""
        if max_tokens is None:
            raise bad_request("max_tokens must be set with use_beam_search", "max_tokens")
        if self.n > max_n:
            raise bad_request(f"n must be at most {max_n} (the server's --max-n), got {self.n}",
                              "n")
        if self.temperature not in (None, 0, 0.0):
            raise bad_request("use_beam_search is deterministic: temperature must be 0 or "
                              "unset", "temperature")
        unsupported = {"stream": self.stream, "top_p": self.top_p, "top_k": self.top_k,
                       "min_p": self.min_p, "seed": self.seed, "stop": self.stop,
                       "stop_token_ids": self.stop_token_ids,
                       "presence_penalty": self.presence_penalty,
                       "frequency_penalty": self.frequency_penalty,
                       "repetition_penalty": self.repetition_penalty,
                       "logit_bias": self.logit_bias, "min_tokens": self.min_tokens,
                       "prompt_logprobs": self.prompt_logprobs,
                       "structured_outputs": self.structured_outputs,
                       **self._fields_beam_search_ignores()}
        for name, value in unsupported.items():
            if value not in (None, False, 0):
                raise bad_request(f"{name} is not supported with use_beam_search", name)
        params = BeamSearchParams(
            beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
            length_penalty=1.0 if self.length_penalty is None else self.length_penalty,
            early_stopping=False if self.early_stopping is None else self.early_stopping)
        try:
            params.validate()
        except ValueError as e:
            raise bad_request(str(e), "length_penalty") from None
        return params

    def _fields_beam_search_ignores(self) -> dict[str, Any]:
        """The request kind's own fields a beam search cannot honour, by name."""
        return {}

    def prompt_logprobs_wanted(self) -> int | None:
        return self.prompt_logprobs

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """What the output must be: the structured_outputs field (ValueError naming
        the problem when it is malformed)."""
        if self.structured_outputs is None:
            return None
        unknown = sorted(set(self.structured_outputs) - {"json", "regex", "choice",
                                                         "json_object"})
        if unknown:
            raise bad_request(f"structured_outputs takes json, regex, choice or json_object, "
                              f"got {unknown}", "structured_outputs")
        return StructuredOutputsParams(**self.structured_outputs)

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias with its keys (token ids, as JSON object keys are strings) as ints."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers as strings), got "
                              f"{sorted(self.logit_bias)[:5]}", "logit_bias") from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        max_n: int) -> SamplingParams:
        """Raises ValueError naming the field for a bad value (answered with 400)."""
        if self.n > max_n:
            raise bad_request(f"n must be at most {max_n} (the server's --max-n), got {self.n}",
                              "n")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise bad_request(f"seed must be at most {SEED_MAX - self.n + 1} when n is {self.n} "
                              f"(sample i draws with seed + i, and seeds end at {SEED_MAX})",
                              "seed")
        values = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs_wanted(), logit_bias=self.token_biases(),
            structured_outputs=self.structured_outputs_params())
        # None means "not given": SamplingParams' own default applies.
        values = {k: v for k, v in values.items() if v is not None}
        return SamplingParams(max_tokens=max_tokens, **values)


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (only best_of == n)", "best_of")

    def _fields_beam_search_ignores(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs, "echo": self.echo}

    def prompt_logprobs_wanted(self) -> int | None:
        """prompt_logprobs, or with echo and logprobs the echoed prompt's: as many."""
        wanted = [k for k in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

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
    model_config = _STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """Roles and content are checked by chat_utils.chat_messages, as for LLM.chat."""

    model_config = ConfigDict(extra="allow", **_STRICT)
    role: Text
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls (chat_utils checks them)
    tool_call_id: Text | None = None  # a tool message's answer to that call


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template: Text | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    # (vLLM's extension) more variables for the chat template, e.g. enable_thinking.
    chat_template_kwargs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.structured_outputs is not None and self.response_format_params() is not None:
            raise bad_request("give response_format or structured_outputs, not both",
                              "structured_outputs")
        if self.tool_choice_name() not in ("none", "auto") and (
                self.structured_outputs is not None or self.response_format_params()):
            raise bad_request("a forced tool_choice shapes the answer itself: give no "
                              "response_format or structured_outputs with it", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    def _fields_beam_search_ignores(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs,
                "tools": self.tools, "response_format": self.response_format}

    def checked_tools(self) -> list[dict] | None:
        if self.tools is None:
            return None
        try:
            return check_tools(self.tools)
        except ValueError as e:
            raise bad_request(str(e), "tools") from None

    def tool_choice_name(self) -> str:
        """"none", "auto", "required" or the forced function's name (tool_calls.py)."""
        try:
            return tool_choice_of(self.tool_choice, self.checked_tools())
        except ValueError as e:
            raise bad_request(str(e), "tool_choice") from None

    def template_messages(self) -> list[dict]:
        """The messages as chat_utils reads them (tool calls and results kept)."""
        keys = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
        return [{k: v for k, v in m.model_dump(include=keys).items() if v is not None
                 or k == "content"} for m in self.messages]

    def response_format_params(self) -> StructuredOutputsParams | None:
        """OpenAI's response_format: text (None), json_object, or json_schema with its
        json_schema.schema."""
        fmt = self.response_format
        if not fmt:
            return None
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind != "json_schema":
            raise bad_request(f"response_format type must be text, json_object or "
                              f"json_schema, got {kind!r}", "response_format")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise bad_request("response_format json_schema needs json_schema.schema (a JSON "
                              "schema)", "response_format")
        return StructuredOutputsParams(json=spec["schema"])

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        forced = forced_schema(self.checked_tools() or [], self.tool_choice_name(),
                               self.parallel_tool_calls)
        if forced is not None:
            return StructuredOutputsParams(json=forced)
        return self.response_format_params() or super().structured_outputs_params()

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
