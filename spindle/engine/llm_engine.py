"""LLMEngine: text in, RequestOutputs out, one step at a time.

It tokenizes and validates requests (through its InputProcessor, unless the prompt
comes already processed), fans n > 1 out into n core requests, steps the
EngineCore and hands its token outputs to the OutputProcessor. Validation happens
here, before anything reaches the scheduler, so a bad request fails alone with a
ValueError and the engine keeps serving. A request that fails later (its
preparation in the runner, its detokenization) finishes alone with an error: its
RequestOutput carries it (see spindle/outputs.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

from spindle.config import EngineArgs, EngineConfig
from spindle.engine.engine_core import EngineCore
from spindle.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from spindle.engine.output_processor import OutputProcessor
from spindle.engine.pause import PauseMode
from spindle.engine.pooling_inputs import POOLING_SAMPLING_PARAMS, check_pooling_params
from spindle.engine.request import Request
from spindle.step_messages import EngineCoreOutput
from spindle.engine.tokenizer_loader import load_tokenizer
from spindle.outputs import RequestOutput
from spindle.pooling_params import PoolingParams
from spindle.sampling_params import SamplingParams
from spindle.structured.compile import GrammarCompiler

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType", "ProcessedPrompt"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The tokenizer first: a bad one fails before any device work. Loading it in a
        # thread beside the engine start was measured slower on the H200 host (the
        # GIL slowed the worker stages more than the overlap saved).
        start = time.perf_counter()
        self.tokenizer = load_tokenizer(config.model.tokenizer, _tokenizer_dir_config(config))
        logger.info("tokenizer loaded in %.2f s", time.perf_counter() - start)
        self.core = EngineCore(config)
        self.eos_token_ids = eos_token_ids(config, self.tokenizer)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        self.grammars = GrammarCompiler()
        self._adapters: dict[int, Any] = {}  # lora_int_id -> the LoRARequest checked for it

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    # ---- requests ---------------------------------------------------------------
    def add_request(self, prompt: PromptType | ProcessedPrompt,
                    params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, final_only: bool = False,
                    lora_request: Any = None, priority: int = 0) -> str:
        """Queue a request. prompt: text, token ids, a dict, or what
        input_processor.process() made of one (then it is not tokenized again).
        final_only: step() reports it only once finished (offline batches), instead of
        its cumulative output after every step (streaming). lora_request: the LoRA
        adapter (spindle.lora.LoRARequest) to serve it with. priority: under
        scheduling_policy="priority", lower is admitted first (else it must be 0)."""
        if self.input_processor.is_pooling(params):
            if lora_request is not None:
                raise ValueError("LoRA adapters are served to generate requests only")
            return self._add_pooling_request(prompt, params, request_id)
        self._check_adapter(lora_request)
        self._check_priority(priority)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # (its fields may have changed since it was made)
        grammar = self._grammar_of(params)
        vocab = self.config.model.vocab_size
        for name, ids in (("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", params.logit_bias)):
            if ids and max(ids) >= vocab:
                raise ValueError(f"{name} must be token ids of the vocabulary [0, {vocab}), "
                                 f"got {max(ids)}")
        if params.n > self.config.scheduler.max_n:
            raise ValueError(f"SamplingParams.n must be at most max_n "
                             f"({self.config.scheduler.max_n}), got {params.n}")
        request_id = request_id or str(next(self._counter))
        self.core.gate.check_accepting()  # paused with mode=abort, or asleep: refuse up front
        self.core.raise_if_dead()  # a failed executor: fail now, before any state is kept
        if self.output_processor.core_request_ids(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.process(prompt, params)
        token_ids = processed.token_ids
        max_tokens = self._resolve_max_tokens(token_ids, params)
        params = params.with_eos(self.eos_token_ids)
        params._grammar = grammar
        children = {_child_id(request_id, i, params.n): params.for_child(i) for i in range(params.n)}
        # (Placeholder ids of prompt embeddings are no tokens to show or detokenize.)
        self.output_processor.add_request(request_id, processed.text,
                                          token_ids if processed.embeds is None else [],
                                          children, final_only)
        for core_id, child_params in children.items():
            self.core.add_request(Request(core_id, token_ids, child_params, max_tokens,
                                          prompt_embeds=processed.embeds,
                                          encoder_inputs=processed.encoder_inputs,
                                          num_encoder_tokens=self.config.model.encoder_positions,
                                          lora_request=lora_request, priority=priority,
                                          cache_salt=processed.cache_salt))
        return request_id

    def _check_priority(self, priority: Any) -> None:
        """The scheduler's rule (request_queue.check_priority), checked before anything
        of the request is kept."""
        from spindle.engine.request_queue import check_priority

        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        check_priority(priority, self.config.scheduler.scheduling_policy)

    def _check_adapter(self, lora_request: Any) -> None:
        """Refuse, before anything runs, a LoRA adapter this engine cannot serve: none
        served, not a LoRARequest, another adapter under the same id, or one whose files
        say it cannot be (read once per id)."""
        if lora_request is None:
            return
        from spindle.lora import LoRARequest
        from spindle.lora.adapter import load_peft_adapter

        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a spindle.lora.LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if self.config.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} asked for, and this "
                             "engine serves none: start it with enable_lora=True")
        known = self._adapters.get(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} names adapter "
                             f"{known.lora_name!r} at {known.lora_path!r} already")
        if known is None:
            load_peft_adapter(lora_request.lora_path, self.config.lora.max_lora_rank)
            self._adapters[lora_request.lora_int_id] = lora_request

    def _grammar_of(self, params: SamplingParams) -> Any:
        """The byte automaton of params.structured_outputs (None without): compiled
        here, so that a bad schema fails its request alone, before any worker sees it."""
        if params.structured_outputs is None:
            return None
        if not self.eos_token_ids:
            raise ValueError("structured_outputs need an end-of-sequence token, and this "
                             "model's tokenizer and configs name none")
        return self.grammars.compile(params.structured_outputs)

    def _add_pooling_request(self, prompt: PromptType | ProcessedPrompt,
                             params: PoolingParams | None, request_id: str | None) -> str:
        """An embedding request: truncating tokenization, one core request that pools."""
        params = check_pooling_params(self.config, params)
        request_id = request_id or str(next(self._counter))
        self.core.gate.check_accepting()
        if self.output_processor.core_request_ids(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.process(prompt, params)
        self.output_processor.add_pooling_request(request_id, processed.text, processed.token_ids)
        self.core.add_request(Request(request_id, processed.token_ids, POOLING_SAMPLING_PARAMS, 1,
                                      pooling_params=params))
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        core_ids = self.output_processor.core_request_ids(request_id)
        if core_ids:
            self.core.abort_requests(core_ids)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        return self._process(self.core.step())

    def update_weights(self, weights: Any, version: int | str | None = None,
                       mode: PauseMode | str = PauseMode.WAIT) -> list[RequestOutput]:
        """Load new weights (see EngineCore.update_weights): a checkpoint directory, a
        state_dict, or an iterable of (name, tensor) pairs in Hugging Face naming.
        Returns the outputs of the requests that settling them finished, tagged with
        the old weights' version."""
        from spindle.models.weight_update import as_weight_source

        old_version = self.core.weight_version
        settled = self.core.update_weights(as_weight_source(weights), version, mode)
        return self._process(settled, old_version)

    def receive_weights(self, version: int | str | None = None,
                        mode: PauseMode | str = PauseMode.WAIT) -> list[RequestOutput]:
        """update_weights with what the trainer's WeightSender sends next (after
        core.init_weight_transfer)."""
        old_version = self.core.weight_version
        return self._process(self.core.receive_weights(version, mode), old_version)

    @property
    def weight_version(self) -> int | str:
        return self.core.weight_version

    def _process(self, core_outputs: list[EngineCoreOutput],
                 weight_version: int | str | None = None) -> list[RequestOutput]:
        """The user-facing outputs of the core's, tagged with the version of the weights
        that produced them (the current one unless given); tell the core what they ended."""
        results, stopped, failed = self.output_processor.process(core_outputs)
        version = self.core.weight_version if weight_version is None else weight_version
        for result in results:
            result.weight_version = version
        if stopped:
            # A stop string ended these samples: the core frees their blocks now.
            self.core.finish_requests(stopped)
        if failed:
            # Samples of requests that failed (a sibling sample's failure included).
            self.core.abort_requests(failed)
        return results

    def can_step(self) -> bool:
        """False when step() would do nothing (no requests, or scheduling paused)."""
        return self.core.can_step()

    def pause(self, mode: PauseMode | str) -> list[RequestOutput]:
        """Pause scheduling (see engine/pause.py); returns the final outputs of the
        requests that mode "abort" finished."""
        return self._process(self.core.pause(mode))

    def resume(self) -> None:
        self.core.resume()

    def sleep(self, level: int = 1, mode: PauseMode | str = PauseMode.KEEP) -> list[RequestOutput]:
        """Sleep (see EngineCore.sleep); returns the outputs of the requests that mode
        "abort" or "wait" finished."""
        return self._process(self.core.sleep(level, mode))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.gate.is_sleeping

    def shutdown(self) -> None:
        self.core.shutdown()

    # ---- validation ---------------------------------------------------------------
    def _resolve_max_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        self.input_processor.check_length(len(token_ids))
        room = self.config.model.max_model_len - len(token_ids)
        return room if params.max_tokens is None else min(params.max_tokens, room)


def _child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def _tokenizer_dir_config(config: EngineConfig) -> Any:
    """The HF config of the tokenizer's directory when it is the model's (AutoTokenizer
    would read it again), else None (also where spindle serves the text model of an
    image-text config: AutoTokenizer picks its class from the outer one)."""
    model = config.model
    if model.tokenizer != model.model or getattr(model.hf_config, "text_model_of", None):
        return None
    return model.hf_config


def eos_token_ids(config: EngineConfig, tokenizer: Any) -> set[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json, united."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(config.model.hf_config, "eos_token_id", None),
                  _generation_config(config.model.model).get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def _generation_config(model_dir: str) -> dict:
    path = Path(model_dir) / "generation_config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        logger.warning("ignoring unreadable %s", path)
        return {}
