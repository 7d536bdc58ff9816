"""POST /v1/completions: prompts in, text completions out, whole or streamed."""

from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator

from spindle.entrypoints.openai.protocol import CompletionRequest, api_error
from spindle.entrypoints.openai.serving_base import (SSE_DONE, OpenAIServing, StreamProgress,
                                                     final_outputs, logprob_token_count,
                                                     merge_streams, prompt_logprobs_json,
                                                     raise_if_aborted, sse, usage, usage_of)
from spindle.outputs import CompletionOutput, Logprob, RequestOutput, finite_logprob
from spindle.sampling_params import SamplingParams


class CompletionServing(OpenAIServing):
    async def create(self, req: CompletionRequest,
                     request_id: str) -> dict[str, Any] | AsyncIterator[str]:
        """The response body, or an iterator of server-sent events when req.stream."""
        model = self.models.resolve(req.model)
        req.refuse_unsupported()
        if req.use_beam_search:
            return await self._beam_search(req, request_id, model)
        params = req.sampling_params(req.max_tokens, req.logprobs, self.max_n)
        prompts = req.prompts()
        special = await self.special_token_ids() if req.logprobs is not None else frozenset()
        streams = await self.start(request_id, prompts, params, model, req.priority,
                                   req.cache_salt)
        header = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                  "model": model}
        if req.stream:
            return self._stream(req, header, streams, params.stop_holdback, special)
        outputs = await final_outputs(streams)
        choices = []
        for i, output in enumerate(outputs):
            prompt_text = await self._prompt_text(output) if req.echo else ""
            echoed = await self._echoed_logprobs(req, output)
            for c in output.outputs:
                raise_if_aborted(c)
                shown = c.token_ids[:logprob_token_count(c, special, req.skip_special_tokens)]
                choice = _choice(i * params.n + c.index, prompt_text + c.text, c,
                                 _logprobs(c, 0, shown, len(prompt_text), echoed))
                choices.append({**choice, **self._prompt_logprobs_field(req, output),
                                "weight_version": output.weight_version})
        return {**header, "choices": choices, "usage": usage_of(outputs)}

    async def _beam_search(self, req: CompletionRequest, request_id: str, model: str
                           ) -> dict[str, Any]:
        """use_beam_search: n choices per prompt, best first (OpenAIServing.beam_search)."""
        params = req.beam_search_params(req.max_tokens, self.max_n)
        prompts = req.prompts()
        token_ids = await self.engine.call(lambda engine: [
            list(engine.input_processor.process(p, SamplingParams()).token_ids)
            for p in prompts])
        sequences, texts = await self.beam_search(req, request_id, model, token_ids, params)
        choices = [{"index": i, "text": text, "logprobs": None,
                    "finish_reason": seq.finish_reason, "stop_reason": None}
                   for i, (seq, text) in enumerate(zip(sequences, texts))]
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model, "choices": choices,
                "usage": usage(sum(len(t) for t in token_ids),
                               sum(len(seq.token_ids) for seq in sequences))}

    async def _echoed_logprobs(self, req: CompletionRequest, output: RequestOutput
                               ) -> dict[str, list] | None:
        """With echo and logprobs, the legacy logprobs lists of the prompt's tokens
        (None for the first token's logprob, which nothing before it predicts)."""
        if not (req.echo and req.logprobs is not None):
            return None
        if output.prompt_logprobs is None:
            raise RuntimeError("echo with logprobs: the engine returned no prompt logprobs")
        ids = output.prompt_token_ids
        first = await self.engine.call(lambda engine: engine.tokenizer.decode(ids[:1]))
        result: dict[str, list] = {"tokens": [first], "token_logprobs": [None],
                                   "top_logprobs": [None], "text_offset": [0]}
        offset = len(first)
        for token, entry in zip(ids[1:], output.prompt_logprobs[1:]):
            offset = _append_position(result, entry, token, offset)
        return result

    @staticmethod
    def _prompt_logprobs_field(req: CompletionRequest, output: RequestOutput) -> dict:
        """vLLM's prompt_logprobs field of a choice, when the request set prompt_logprobs."""
        if req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(output.prompt_logprobs)}

    async def _stream(self, req: CompletionRequest, header: dict, streams, holdback: int,
                      special: frozenset[int]) -> AsyncIterator[str]:
        n = req.n
        progress: dict[int, StreamProgress] = {}
        finished: list[RequestOutput] = []  # (for the usage chunk)
        try:
            async with contextlib.aclosing(merge_streams(streams)) as outputs:
                async for i, output in outputs:
                    for c in output.outputs:
                        raise_if_aborted(c)
                        state = progress.setdefault(i * n + c.index, StreamProgress())
                        first_chunk = not state.started
                        echo = await self._prompt_text(output) if req.echo and first_chunk else ""
                        state.started = True
                        state.text_offset += len(echo)
                        chars_before = state.chars
                        taken = state.take(c, holdback)
                        with_prompt_logprobs = first_chunk and req.prompt_logprobs is not None
                        if taken is None and not echo and not with_prompt_logprobs:
                            continue
                        text, first, end = taken or ("", state.tokens, state.tokens)
                        if state.finished:
                            end = max(first, min(end, logprob_token_count(
                                c, special, req.skip_special_tokens)))
                        offset = state.text_offset + chars_before
                        echoed = await self._echoed_logprobs(req, output) if echo else None
                        choice = _choice(i * n + c.index, echo + text, c,
                                         _logprobs(c, first, c.token_ids[first:end], offset,
                                                   echoed))
                        if not state.finished:
                            choice["finish_reason"] = choice["stop_reason"] = None
                        if with_prompt_logprobs:  # (vLLM: with a sample's first chunk)
                            choice.update(self._prompt_logprobs_field(req, output))
                        choice["weight_version"] = output.weight_version
                        yield sse({**header, "choices": [choice]})
                    if output.finished:
                        finished.append(output)
            if req.include_usage_in_stream():
                yield sse({**header, "choices": [], "usage": usage_of(finished)})
        except Exception as e:  # the headers are sent: report in-band, as OpenAI does
            yield sse(api_error(e).body())
        yield SSE_DONE

    async def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        ids = output.prompt_token_ids
        return await self.engine.call(lambda engine: engine.tokenizer.decode(ids))


def _choice(index: int, text: str, completion: CompletionOutput,
            logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


def _logprobs(completion: CompletionOutput, first: int, token_ids: list[int],
              text_offset: int, echoed: dict[str, list] | None = None
              ) -> dict[str, Any] | None:
    """The legacy completions logprobs object for token_ids (which start at index
    first of the sample): the sampled token's logprob and, per position, the
    sampled token plus the top-k; after the echoed prompt's lists when given."""
    if completion.logprobs is None:
        return None
    result: dict[str, list] = {key: list(values) for key, values in echoed.items()} \
        if echoed else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                        "text_offset": []}
    for token, entry in zip(token_ids, completion.logprobs[first:first + len(token_ids)]):
        text_offset = _append_position(result, entry, token, text_offset)
    return result


def _append_position(result: dict[str, list], entry: dict[int, Logprob], token: int,
                     text_offset: int) -> int:
    """Append one position (its token's entry among entry) to the legacy logprobs
    lists; returns the text offset after it."""
    chosen: Logprob = entry[token]
    text = chosen.decoded_token or ""
    result["tokens"].append(text)
    result["token_logprobs"].append(finite_logprob(chosen.logprob))
    result["top_logprobs"].append({lp.decoded_token or "": finite_logprob(lp.logprob)
                                   for lp in entry.values()})
    result["text_offset"].append(text_offset)
    return text_offset + len(text)
