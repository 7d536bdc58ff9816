"""POST /v1/chat/completions: a conversation, rendered with the tokenizer's chat
template (the same rendering as LLM.chat), answered whole or streamed."""

from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import Any, AsyncIterator, Callable

from spindle.entrypoints.chat_utils import chat_messages, render_chat_prompt
from spindle.entrypoints.openai.protocol import ChatCompletionRequest, api_error, bad_request
from spindle.entrypoints.openai.serving_base import (SSE_DONE, OpenAIServing, StreamProgress,
                                                     final_outputs, logprob_token_count,
                                                     merge_streams, prompt_logprobs_json,
                                                     raise_if_aborted, sse, usage, usage_of)
from spindle.entrypoints.reasoning import (ReasoningSplitter, split_reasoning,
                                          splits_constrained_answers)
from spindle.entrypoints.tool_calls import (KEEPS_SPECIAL_TOKENS, TOOL_CALL_PARSERS,
                                            RequiredCallStream, ToolCall, ToolCallStream,
                                            forced_calls)
from spindle.outputs import CompletionOutput, RequestOutput, finite_logprob


class ChatServing(OpenAIServing):
    def __init__(self, engine: Any, models: Any, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        super().__init__(engine, models)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    async def create(self, req: ChatCompletionRequest,
                     request_id: str) -> dict[str, Any] | AsyncIterator[str]:
        """The response body, or an iterator of server-sent events when req.stream."""
        model = self.models.resolve(req.model)
        req.refuse_unsupported()
        if req.use_beam_search:
            return await self._beam_search(req, request_id, model)
        tools, calls = self._tool_calls_wanted(req)
        params = req.sampling_params(req.max_new_tokens(), req.logprobs_wanted(), self.max_n)
        if calls == "auto" and self.tool_call_parser in KEEPS_SPECIAL_TOKENS:
            params.skip_special_tokens = False  # (its calls start with a special token)
        conversation = chat_messages(req.template_messages())
        special = await self.special_token_ids() if req.logprobs else frozenset()
        # Rendered and tokenized in a tokenizer thread, not on the engine's.
        prompt = await self.engine.with_tokenizer(lambda tokenizer: render_chat_prompt(
            tokenizer, conversation, req.add_generation_prompt, req.chat_template, tools,
            req.chat_template_kwargs))
        streams = await self.start(request_id, [prompt], params, model, req.priority,
                                   req.cache_salt)
        created = int(time.time())
        reasoning = self._reasoning_parser_for(params)
        if req.stream:
            header = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                      "model": model}
            return self._stream(req, header, streams, params.stop_holdback, special,
                                self._deltas_maker(calls, reasoning))
        (output,) = await final_outputs(streams)
        k = req.top_logprobs or 0
        choices = []
        for c in output.outputs:
            raise_if_aborted(c)
            shown = c.token_ids[:logprob_token_count(c, special, req.skip_special_tokens)]
            message, finish_reason = _message(c, calls, reasoning, self.tool_call_parser)
            choices.append({"index": c.index, "message": message,
                            "logprobs": _logprobs(c, 0, shown, k),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                            "weight_version": output.weight_version})
        body = {"id": request_id, "object": "chat.completion", "created": created,
                "model": model, "choices": choices, "usage": usage_of([output])}
        if req.prompt_logprobs is not None:  # (vLLM's extension, beside the choices)
            body["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        return body

    def _tool_calls_wanted(self, req: ChatCompletionRequest) -> tuple[list | None, str | None]:
        """(the tools, the tool choice to read calls by: None for none); 400 for auto
        on a server without a parser."""
        tools, choice = req.checked_tools(), req.tool_choice_name()
        if choice == "auto" and tools and self.tool_call_parser is None:
            raise bad_request("tool_choice auto (the default with tools) needs a server "
                              "started with --tool-call-parser; or force a choice (required, "
                              "or a named function)", "tool_choice")
        return tools, choice if tools and choice != "none" else None

    def _deltas_maker(self, calls: str | None, reasoning: str | None) -> Callable:
        """What makes a streamed choice's deltas: calls is None (no tools), "auto" (read
        by the server's parser), "required" or a forced function's name."""
        auto = calls == "auto"
        return partial(_ChoiceDeltas, reasoning, None if auto else calls,
                       self.tool_call_parser if auto else None)

    def _reasoning_parser_for(self, params: Any) -> str | None:
        """The parser that splits this request's answers (None: no split)."""
        parser = self.reasoning_parser
        if parser and params.structured_outputs is not None \
                and not splits_constrained_answers(parser):
            return None
        return parser

    async def _beam_search(self, req: ChatCompletionRequest, request_id: str, model: str
                           ) -> dict[str, Any]:
        """use_beam_search: n assistant messages, best first (OpenAIServing.beam_search)."""
        params = req.beam_search_params(req.max_new_tokens(), self.max_n)
        conversation = chat_messages(req.template_messages())
        prompt = await self.engine.with_tokenizer(lambda tokenizer: render_chat_prompt(
            tokenizer, conversation, req.add_generation_prompt, req.chat_template, None,
            req.chat_template_kwargs))
        token_ids = list(prompt["prompt_token_ids"])
        sequences, texts = await self.beam_search(req, request_id, model, [token_ids], params)
        choices = [{"index": i, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": None}
                   for i, (seq, text) in enumerate(zip(sequences, texts))]
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": choices,
                "usage": usage(len(token_ids), sum(len(seq.token_ids) for seq in sequences))}

    async def _stream(self, req: ChatCompletionRequest, header: dict, streams, holdback: int,
                      special: frozenset[int],
                      make_deltas: Callable[[], "_ChoiceDeltas"]) -> AsyncIterator[str]:
        """Each choice's text as it comes, made into deltas by its own make_deltas()."""
        progress: dict[int, StreamProgress] = {}
        deltas: dict[int, _ChoiceDeltas] = {}
        k = req.top_logprobs or 0
        finished: list[RequestOutput] = []  # (for the usage chunk)
        try:
            async with contextlib.aclosing(merge_streams(streams)) as outputs:
                async for _, output in outputs:
                    for c in output.outputs:
                        raise_if_aborted(c)
                        state = progress.setdefault(c.index, StreamProgress())
                        if not state.started:  # OpenAI opens each choice with the role alone
                            state.started = True
                            yield sse({**header, "choices": [_delta_choice(
                                c.index, {"role": "assistant", "content": ""},
                                weight_version=output.weight_version)]})
                        taken = state.take(c, holdback)
                        if taken is None:
                            continue
                        text, first, end = taken
                        if state.finished:
                            end = max(first, min(end, logprob_token_count(
                                c, special, req.skip_special_tokens)))
                        delta, finish_reason = deltas.setdefault(c.index, make_deltas()).make(
                            text, state.finished, c.finish_reason)
                        choice = _delta_choice(c.index, delta,
                                               _logprobs(c, first, c.token_ids[first:end], k),
                                               output.weight_version)
                        if state.finished:
                            choice["finish_reason"], choice["stop_reason"] = (finish_reason,
                                                                              c.stop_reason)
                        yield sse({**header, "choices": [choice]})
                    if output.finished:
                        finished.append(output)
            if req.include_usage_in_stream():
                yield sse({**header, "choices": [], "usage": usage_of(finished)})
        except Exception as e:  # the headers are sent: report in-band, as OpenAI does
            yield sse(api_error(e).body())
        yield SSE_DONE


class _ChoiceDeltas:
    """How one streamed choice's new text becomes its delta: as content; split into
    reasoning and reply (reasoning: the server's parser); a forced function's argument
    deltas (named_call); with tool_choice required (named_call "required") each call's
    name, then its argument deltas, as the list is written; or, with tool_choice auto
    (auto_parser), content for as long as it surely is content, the calls read when the
    answer ends."""

    def __init__(self, reasoning: str | None, named_call: str | None,
                 auto_parser: str | None) -> None:
        self.splitter = ReasoningSplitter(reasoning) if reasoning else None
        self.named_call = named_call
        self.required = RequiredCallStream() if named_call == "required" else None
        self.tools = ToolCallStream(auto_parser) if auto_parser else None
        self.opened = False  # the forced call's id and name were sent

    def make(self, text: str, finished: bool,
             finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the delta, the choice's finish reason once finished)."""
        if self.required is not None:
            entries = self.required.feed(text)
            return ({"tool_calls": entries} if entries else {},
                    "tool_calls" if finish_reason == "stop" else finish_reason)
        if self.named_call is not None:
            delta = _argument_delta(self.named_call, text, not self.opened)
            self.opened = True
            return delta, "tool_calls" if finish_reason == "stop" else finish_reason
        thought, content = self.splitter.feed(text, finished) if self.splitter else ("", text)
        calls: list = []
        if self.tools is not None:
            content = self.tools.feed(content)
            if finished:
                rest, calls = (self.tools.finish() if finish_reason == "stop"
                               else (self.tools.unsent(), []))
                content += rest
        delta = {key: value for key, value in (("reasoning_content", thought),
                                               ("content", content)) if value}
        if calls:
            delta["tool_calls"] = [{"index": i, **call.to_openai()}
                                   for i, call in enumerate(calls)]
            return delta, "tool_calls"
        return delta, finish_reason


def _message(c: CompletionOutput, calls: str | None, reasoning: str | None,
             tool_call_parser: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished answer, and its finish reason: its reasoning
    split off (reasoning: the server's parser), and with tools (calls: the tool choice)
    its tool calls read out, by the server's parser for auto (finish reason
    "tool_calls" when there are any)."""
    thought, text = split_reasoning(c.text, reasoning) if reasoning else (None, c.text)
    message = {"role": "assistant", "content": text}
    if thought is not None:
        message["reasoning_content"] = thought
    if calls is None or c.finish_reason != "stop":
        return message, c.finish_reason
    if calls == "auto":
        content, found = TOOL_CALL_PARSERS[tool_call_parser](text) if text else (text, [])
    else:
        try:
            content, found = None, forced_calls(c.text, calls)
        except ValueError:  # (a stop string cut the JSON short: the text as it is)
            content, found = c.text, []
    message["content"] = content
    if not found:
        return message, c.finish_reason
    message["tool_calls"] = [call.to_openai() for call in found]
    return message, "tool_calls"


def _argument_delta(name: str, text: str, opens: bool) -> dict[str, Any]:
    """A forced call's streamed delta: its id, type and name first, then arguments."""
    call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
    if opens:
        opened = ToolCall(name, "").to_openai()
        call.update(id=opened["id"], type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def _delta_choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
                  weight_version: int | str = 0) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None,
            "weight_version": weight_version}


def _logprobs(completion: CompletionOutput, first: int, token_ids: list[int],
              k: int) -> dict[str, Any] | None:
    """The chat logprobs object: per token, its logprob and the k most likely tokens."""
    if completion.logprobs is None:
        return None
    content = []
    for token, entry in zip(token_ids, completion.logprobs[first:first + len(token_ids)]):
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        content.append({**_token_logprob(entry[token].decoded_token, entry[token].logprob),
                        "top_logprobs": [_token_logprob(lp.decoded_token, lp.logprob)
                                         for lp in top]})
    return {"content": content}


def _token_logprob(token: str | None, logprob: float) -> dict[str, Any]:
    token = token or ""
    return {"token": token, "logprob": finite_logprob(logprob),
            "bytes": list(token.encode("utf-8"))}
