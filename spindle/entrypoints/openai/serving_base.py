"""What the completions and chat endpoints share: the served model names, the
request ids in flight, starting a request's prompts in the engine, merging their
output streams, the text and logprobs each streamed chunk may carry, aborted
requests, server-sent events and usage."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from spindle.engine.async_llm import AsyncLLM, RequestStream
from spindle.engine.llm_engine import PromptType
from spindle.entrypoints.beam_search import beam_search_async, check_fits
from spindle.entrypoints.openai.protocol import APIError, bad_request, request_aborted
from spindle.outputs import CompletionOutput, RequestOutput, finite_logprob
from spindle.sampling_params import SamplingParams

SSE_DONE = "data: [DONE]\n\n"


class AdapterRegistry:
    """The LoRA adapters a server answers to by name (--lora-modules, and those loaded
    or unloaded at run time): name -> LoRARequest, ids never reused."""

    def __init__(self, adapters: Sequence[Any] = ()) -> None:
        self._by_name = {a.lora_name: a for a in adapters}
        self._next_id = max((a.lora_int_id for a in adapters), default=0) + 1

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def get(self, name: str) -> Any:
        return self._by_name.get(name)

    def add(self, name: str, path: str) -> Any:
        from spindle.lora import LoRARequest

        adapter = self._by_name[name] = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return adapter

    def remove(self, name: str) -> None:
        del self._by_name[name]


@dataclass(frozen=True)
class ServedModels:
    """The names clients may ask for; all of them mean one loaded model, the adapters'
    names that model with a LoRA adapter."""

    names: tuple[str, ...]
    root: str  # the checkpoint directory
    max_model_len: int
    adapters: AdapterRegistry = field(default_factory=AdapterRegistry)

    @property
    def all_names(self) -> tuple[str, ...]:
        return self.names + tuple(a.lora_name for a in self.adapters)

    def resolve(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None:
            return self.names[0]
        if requested not in self.all_names:
            raise model_not_found(requested, self.all_names)
        return requested

    def adapter(self, name: str) -> Any:
        """The LoRARequest a resolved name means (None: the base model)."""
        return self.adapters.get(name)

    def card(self, name: str) -> dict[str, Any]:
        adapter = self.adapter(name)
        card = {"id": name, "object": "model", "created": int(time.time()),
                "owned_by": "spindle", "max_model_len": self.max_model_len,
                "root": self.root if adapter is None else adapter.lora_path}
        if adapter is not None:
            card["parent"] = self.names[0]
        return card


def model_not_found(requested: str, names: Sequence[str]) -> APIError:
    return APIError(404, f"the model {requested!r} does not exist; this server serves "
                    f"{', '.join(repr(n) for n in names)}", param="model",
                    code="model_not_found")


class RequestIds:
    """The ids of the requests in flight: a client's X-Request-Id may name only one at
    a time (the engine's ids are derived from it)."""

    def __init__(self) -> None:
        self._live: set[str] = set()

    def claim(self, request_id: str) -> None:
        if request_id in self._live:
            raise APIError(400, f"X-Request-Id {request_id!r} is already in use by a request "
                           "in flight; send a unique id per request", param="X-Request-Id",
                           code="duplicate_request_id")
        self._live.add(request_id)

    def release(self, request_id: str) -> None:
        self._live.discard(request_id)


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, models: ServedModels) -> None:
        self.engine = engine
        self.models = models
        self._special_ids: frozenset[int] | None = None

    @property
    def max_n(self) -> int:
        return self.engine.config.scheduler.max_n

    async def special_token_ids(self) -> frozenset[int]:
        """The ids a decode with skip_special_tokens leaves out (read once, on the engine
        thread, which owns the tokenizer)."""
        if self._special_ids is None:
            self._special_ids = await self.engine.call(
                lambda engine: tokenizer_special_ids(engine.tokenizer))
        return self._special_ids

    async def beam_search(self, req: Any, request_id: str, model: str,
                          token_ids: list[list[int]], params: Any) -> tuple[list, list[str]]:
        """use_beam_search for each prompt (token ids; entrypoints/beam_search.py): every
        prompt's beam_width sequences, best first, one after another, and their text.
        Each step's beams go to the engine as one-token requests (request_id-beamS-B)
        beside the others in flight; the prefix cache serves what they share."""
        try:
            check_fits(token_ids, params, self.models.max_model_len)
        except ValueError as e:
            raise bad_request(str(e), "max_tokens") from None
        eos = await self.engine.call(lambda engine: frozenset(engine.eos_token_ids))
        steps = itertools.count()

        async def step(beams: list[list[int]], step_params: SamplingParams) -> list:
            streams = await self.start(f"{request_id}-beam{next(steps)}",
                                       [{"prompt_token_ids": b} for b in beams], step_params,
                                       model, req.priority, req.cache_salt)
            outputs = await final_outputs(streams)
            for output in outputs:
                raise_if_aborted(output.outputs[0])
            return outputs

        results = await beam_search_async(step, token_ids, params, eos)
        sequences = [seq for result in results for seq in result.sequences]
        texts = await self.engine.call(lambda engine: [engine.tokenizer.decode(
            seq.token_ids, skip_special_tokens=req.skip_special_tokens) for seq in sequences])
        return sequences, texts

    async def start(self, request_id: str, prompts: Sequence[PromptType],
                    params: SamplingParams, model: str | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> list[RequestStream]:
        """Add every prompt (engine ids request_id-0, -1, ...), with the LoRA adapter
        the resolved model name means, if any, priority and cache_salt; all or nothing."""
        adapter = None if model is None else self.models.adapter(model)
        if cache_salt is not None:
            prompts = [salted(prompt, cache_salt) for prompt in prompts]
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(prompt, params, f"{request_id}-{i}",
                                                             lora_request=adapter,
                                                             priority=priority))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams


def salted(prompt: PromptType, salt: str) -> dict:
    """prompt as a prompt dict with cache_salt."""
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": salt}
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    return {"prompt_token_ids": list(prompt), "cache_salt": salt}


async def merge_streams(streams: Sequence[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come. Leaving early, or an
    error in one stream, aborts every request still running."""
    if len(streams) == 1:  # the common case needs no tasks
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as e:
            queue.put_nowait((index, e))
        finally:
            stream.close()
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Wait for every request to finish; their last outputs, in prompt order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in merge_streams(streams):
        finals[index] = output
    return finals  # type: ignore[return-value]


@dataclass
class StreamProgress:
    """How much of one choice (one sample of one prompt) the client has been sent."""

    chars: int = 0
    tokens: int = 0
    text_offset: int = 0  # characters sent ahead of the sample's own text (an echoed prompt)
    started: bool = False
    finished: bool = False

    def take(self, completion: CompletionOutput, holdback: int) -> tuple[str, int, int] | None:
        """(new text, first new token, end token) to send now, or None if nothing.

        While a sample runs, the last holdback characters stay back: the output
        processor cuts a stop string off the text once it completes, and text that
        may yet become part of one must not reach the client first.
        """
        if self.finished:
            return None
        self.finished = completion.finish_reason is not None
        text = completion.text
        end = len(text) if self.finished else max(self.chars, len(text) - holdback)
        delta, first_token = text[self.chars:end], self.tokens
        self.chars, self.tokens = end, len(completion.token_ids)
        # Tokens without text (part of a character) are worth a chunk only for their logprobs.
        new_tokens = first_token < self.tokens and completion.logprobs is not None
        if not (delta or new_tokens or self.finished):
            return None
        return delta, first_token, self.tokens


def tokenizer_special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids a decode with skip_special_tokens leaves out."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


def logprob_token_count(completion: CompletionOutput, special_ids: frozenset[int],
                        skip_special_tokens: bool) -> int:
    """How many of the sample's tokens its logprobs report: all but a final stop token
    (EOS, or one of stop_token_ids) that the text leaves out, as a special token under
    skip_special_tokens. The logprobs describe the text the client gets."""
    token_ids = completion.token_ids
    hidden = (completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str)
              and skip_special_tokens and bool(token_ids) and token_ids[-1] in special_ids)
    return len(token_ids) - hidden


def raise_if_aborted(completion: CompletionOutput) -> None:
    """An aborted sample fails its request: the OpenAI API has no finish reason for it."""
    if completion.finish_reason == "abort":
        raise request_aborted()



def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    """OpenAI's usage, prompt_tokens_details.cached_tokens: the prompt tokens the prefix
    cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_of(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """Each prompt counts once, however many samples (n) it has."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return usage(prompt, completion, cached_tokens_of(outputs))


def cached_tokens_of(outputs: Sequence[RequestOutput]) -> int:
    return sum(o.num_cached_tokens or 0 for o in outputs)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def prompt_logprobs_json(prompt_logprobs: list | None) -> list | None:
    """RequestOutput.prompt_logprobs as vLLM's servers give it: per prompt token None
    or {token id (a string): {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else {
        str(token): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank,
                     "decoded_token": lp.decoded_token} for token, lp in entry.items()}
        for entry in prompt_logprobs]
