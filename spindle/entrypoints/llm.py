"""The offline API: `LLM(model=...)`, `llm.generate(...)`, `llm.chat(...)`,
`llm.embed(...)` (with `LLM(model, task="embed")`).

Shaped like vLLM's LLM class so that code written for it runs here unchanged for
the features spindle has.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Sequence

from tqdm import tqdm

from spindle.config import EngineArgs
from spindle.engine.llm_engine import LLMEngine, PromptType
from spindle.engine.pooling_inputs import pretokenize
from spindle.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams
from spindle.entrypoints.chat_utils import render_chat_prompt
from spindle.entrypoints.tool_calls import check_tools
from spindle.lora import LoRARequest
from spindle.logger import configure_logging
from spindle.outputs import EmbeddingRequestOutput, RequestFailedError, RequestOutput
from spindle.pooling_params import PoolingParams
from spindle.sampling_params import SamplingParams

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)}


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _ENGINE_FIELDS)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; "
                            f"known: {sorted(_ENGINE_FIELDS - {'model'})}")
        configure_logging()
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        # An LLM dropped without shutdown() still stops its workers and gives the device
        # memory back (freeze_gc_heap hid the engine's cycles from the collector).
        # At interpreter exit the executors' own exit hooks stop the workers instead.
        self._shutdown = weakref.finalize(self, self.engine.shutdown)
        self._shutdown.atexit = False

    @property
    def config(self):
        return self.engine.config

    def get_tokenizer(self) -> Any:
        """transformers' tokenizer of the model (AutoTokenizer's). The engine itself may
        hold a CachedTokenizer (engine/cached_tokenizer.py: the same tokenizer without
        transformers, read from the start cache); this then loads transformers' on its
        first call."""
        return getattr(self.engine.tokenizer, "hf_tokenizer", self.engine.tokenizer)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. lora_request:
        the LoRA adapter for every prompt, or one per prompt (None: the base model);
        needs LLM(..., enable_lora=True). priority: for every prompt or one per prompt,
        lower admitted first; needs LLM(..., scheduling_policy="priority").

        Bad input raises ValueError before anything runs. A request that fails while
        it runs (RequestFailedError, naming it and the cause) fails the call: the
        other requests are aborted, and the engine serves the next call."""
        prompts = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        adapters = _adapters_per_prompt(lora_request, len(prompts))
        priorities = _priorities_per_prompt(priority, len(prompts))
        return self._run(self._add_all(prompts, params, adapters, priorities), use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for every prompt, as transformers' generate(num_beams=
        params.beam_width) searches (entrypoints/beam_search.py): each output holds the
        beam_width best sequences, best first. Steps run through the engine (the
        prefix cache serves what the beams share: keep it on)."""
        from spindle.entrypoints.beam_search import beam_search, check_fits
        from spindle.sampling_params import SamplingParams

        params.validate()
        token_ids = [self.engine.input_processor.process(p, SamplingParams()).token_ids
                     for p in _as_prompt_list(prompts)]
        check_fits(token_ids, params, self.config.model.max_model_len)
        return beam_search(self, token_ids, params, frozenset(self.engine.eos_token_ids))

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order. Texts are tokenized in one batch,
        truncated to the model's max length; the empty string is a valid text."""
        if self.config.model.task != "embed":
            raise ValueError(f"embed() needs an engine started with task='embed' (this one "
                             f"runs task={self.config.model.task!r})")
        prompts = pretokenize(self.engine.tokenizer, _as_prompt_list(prompts), self.config)
        params = _params_per_prompt(pooling_params, len(prompts), PoolingParams)
        return self._run(self._add_all(prompts, params), use_tqdm, desc="Embedding")

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template, then generate.
        tools: OpenAI-style function entries the template shows the model;
        chat_template_kwargs: more template variables (say enable_thinking=False);
        lora_request: as generate's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            raise ValueError("chat() needs at least one conversation")
        prompts = [self.render_chat(c, add_generation_prompt, chat_template, tools,
                                    chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def render_chat(self, conversation: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> dict:
        return render_chat_prompt(self.engine.tokenizer, conversation, add_generation_prompt,
                                  chat_template, check_tools(tools) if tools else None,
                                  chat_template_kwargs)

    # ---- sleep mode ----------------------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "keep") -> None:
        """Give the GPU back until wake_up().

        level 0: stop scheduling only. level 1: weights copied to host memory, KV cache
        dropped. level 2: both dropped; wake_up reloads the weights from the
        checkpoint. Levels 1 and 2 need LLM(..., enable_sleep_mode=True). mode, for
        unfinished requests: "keep" (continue them after waking), "wait" (finish them
        first) or "abort". Cached prefixes are forgotten.
        """
        self.engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake tags: "weights", "kv_cache", "scheduling" (None: everything asleep).
        Waking in stages lets the weights be updated before the cache takes memory:
        wake_up(["weights"]), then wake_up(["kv_cache", "scheduling"])."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def update_weights(self, weights: Any, version: int | str | None = None) -> None:
        """Load new weights into the running engine, in place: a checkpoint directory,
        a state_dict, or an iterable of (name, tensor) pairs in Hugging Face naming (what
        a trainer's named_parameters() gives). Every tensor is checked against the
        checkpoint the engine started from (names, shapes) before any is copied, so a
        bad source raises ValueError and changes nothing. Tensor-parallel ranks each
        take their shard. The prefix cache is dropped. Outputs from then on carry
        weight_version = version (default: the number of updates so far).

        With sleep mode, the weights alone can be woken for it: sleep(2),
        wake_up(["weights"]), update_weights(...), wake_up()."""
        self.engine.update_weights(weights, version)

    def init_weight_transfer(self, address: str, timeout_s: float = 300.0) -> None:
        """Join a trainer's spindle.rl.WeightSender (its .address, HOST:PORT); the
        trainer calls sender.connect() meanwhile, and this returns once every worker is
        connected. timeout_s bounds each wait on the trainer."""
        self.engine.core.init_weight_transfer(address, timeout_s)

    def receive_weights(self, version: int | str | None = None) -> None:
        """update_weights with what the trainer's next sender.send(weights) sends: checked
        whole on every rank first (a bad list raises ValueError here, RuntimeError
        there, and nothing changes), then loaded batch by batch as it arrives."""
        self.engine.receive_weights(version)

    @property
    def weight_version(self) -> int | str:
        """The version of the weights outputs come from now (0: the checkpoint's)."""
        return self.engine.weight_version

    def sleep_state(self) -> dict:
        """Sleep level, tags asleep and, per worker, device and host bytes by tag."""
        return self.engine.core.sleep_state()

    def heartbeats(self) -> list:
        """Per worker rank: the stage or call it last entered, its last step, the
        seconds since, and whether it is still inside (a hung rank stays busy)."""
        return self.engine.core.executor.heartbeats()

    def shutdown(self) -> None:
        self._shutdown()  # (once: a second call, or the finalizer after it, does nothing)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _add_all(self, prompts: list, params: list, adapters: list | None = None,
                 priorities: list | None = None) -> list[str]:
        ids = []
        n = len(prompts)
        try:
            for prompt, p, adapter, priority in zip(prompts, params, adapters or [None] * n,
                                                    priorities or [0] * n):
                ids.append(self.engine.add_request(prompt, p, final_only=True,
                                                   lora_request=adapter, priority=priority))
        except Exception:
            for request_id in ids:  # all or nothing: do not leave half a batch queued
                self.engine.abort_request(request_id)
            raise
        return ids

    def _run(self, request_ids: list[str], use_tqdm: bool, desc: str = "Generating") -> list:
        pending = set(request_ids)
        finished: dict[str, Any] = {}
        bar = tqdm(total=len(request_ids), desc=desc, disable=not use_tqdm, dynamic_ncols=True)
        try:
            while pending:
                for out in self.engine.step():
                    if out.error is not None and out.request_id in pending:
                        # It failed alone; the rest of the call is aborted below.
                        raise RequestFailedError(out.request_id, out.error,
                                                 request_ids.index(out.request_id))
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("generate() needs a non-empty prompt or list of prompts")
    return list(prompts)


def _priorities_per_prompt(priority: Any, n: int) -> list:
    return _per_prompt(priority, n, lambda v: isinstance(v, int), "priorities")


def _adapters_per_prompt(lora_request: Any, n: int) -> list:
    return _per_prompt(lora_request, n, lambda v: v is None or isinstance(v, LoRARequest),
                       "LoRA requests")


def _params_per_prompt(params: Any, n: int, kind: type = SamplingParams) -> list:
    return _per_prompt(kind() if params is None else params, n,
                       lambda v: isinstance(v, kind), kind.__name__)


def _per_prompt(value: Any, n: int, single: Any, what: str) -> list:
    """value for each of n prompts where single(value), else value's items, one per
    prompt (ValueError for another count)."""
    if single(value):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} prompts")
    return values
