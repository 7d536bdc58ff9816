"""POST /v1/chat/completions: a conversation, rendered with the tokenizer's chat
template (the same rendering as LLM.chat), answered whole or streamed."""

from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator

from spindle.entrypoints.chat_utils import chat_messages, render_chat_prompt
from spindle.entrypoints.openai.protocol import ChatCompletionRequest, api_error
from spindle.entrypoints.openai.serving_base import (SSE_DONE, OpenAIServing, StreamProgress,
                                                     final_outputs, logprob_token_count,
                                                     merge_streams, prompt_logprobs_json,
                                                     raise_if_aborted, sse, usage, usage_of)
from spindle.outputs import CompletionOutput, finite_logprob


class ChatServing(OpenAIServing):
    async def create(self, req: ChatCompletionRequest,
                     request_id: str) -> dict[str, Any] | AsyncIterator[str]:
        """The response body, or an iterator of server-sent events when req.stream."""
        model = self.models.resolve(req.model)
        req.refuse_unsupported()
        params = req.sampling_params(req.max_new_tokens(), req.logprobs_wanted(), self.max_n)
        conversation = chat_messages([m.model_dump(include={"role", "content"})
                                      for m in req.messages])
        special = await self.special_token_ids() if req.logprobs else frozenset()
        # Rendered and tokenized in a tokenizer thread, not on the engine's.
        prompt = await self.engine.with_tokenizer(lambda tokenizer: render_chat_prompt(
            tokenizer, conversation, req.add_generation_prompt, req.chat_template))
        streams = await self.start(request_id, [prompt], params)
        created = int(time.time())
        if req.stream:
            header = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                      "model": model}
            return self._stream(req, header, streams, params.stop_holdback, special)
        (output,) = await final_outputs(streams)
        k = req.top_logprobs or 0
        choices = []
        for c in output.outputs:
            raise_if_aborted(c)
            shown = c.token_ids[:logprob_token_count(c, special, req.skip_special_tokens)]
            choices.append({"index": c.index,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": _logprobs(c, 0, shown, k),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "weight_version": output.weight_version})
        body = {"id": request_id, "object": "chat.completion", "created": created,
                "model": model, "choices": choices, "usage": usage_of([output])}
        if req.prompt_logprobs is not None:  # (vLLM's extension, beside the choices)
            body["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        return body

    async def _stream(self, req: ChatCompletionRequest, header: dict, streams, holdback: int,
                      special: frozenset[int]) -> AsyncIterator[str]:
        progress: dict[int, StreamProgress] = {}
        k = req.top_logprobs or 0
        prompt_tokens = completion_tokens = 0
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
                        choice = _delta_choice(c.index, {"content": text} if text else {},
                                               _logprobs(c, first, c.token_ids[first:end], k),
                                               output.weight_version)
                        if state.finished:
                            choice["finish_reason"], choice["stop_reason"] = (c.finish_reason,
                                                                              c.stop_reason)
                        yield sse({**header, "choices": [choice]})
                    if output.finished:
                        prompt_tokens += len(output.prompt_token_ids)
                        completion_tokens += sum(len(c.token_ids) for c in output.outputs)
            if req.include_usage_in_stream():
                yield sse({**header, "choices": [], "usage": usage(prompt_tokens,
                                                                   completion_tokens)})
        except Exception as e:  # the headers are sent: report in-band, as OpenAI does
            yield sse(api_error(e).body())
        yield SSE_DONE


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
