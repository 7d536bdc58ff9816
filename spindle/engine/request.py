"""A request as the engine core sees it: token ids, progress and status.

It knows nothing of text (the output processor detokenizes) nor of devices.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from spindle.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed alone (its preparation raised); the engine serves on

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated (n > 1 is fanned out into n Requests upstream).

    Invariants: all_token_ids == prompt_token_ids + output_token_ids;
    0 <= num_computed_tokens <= num_tokens (tokens whose KV is in the cache or
    scheduled to be written this step); max_tokens is already resolved against
    max_model_len by the engine.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int,
                 arrival_time: float | None = None, pooling_params: Any = None,
                 prompt_embeds: Any = None, encoder_inputs: Any = None,
                 num_encoder_tokens: int = 0, lora_request: Any = None,
                 priority: int = 0, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        # Its prefix-cache blocks are shared only with requests of the same salt.
        self.cache_salt = cache_salt
        # Under the priority scheduling policy, lower goes first (request_queue.py).
        self.priority = priority
        # The LoRA adapter it is served with (spindle.lora.LoRARequest; None: none).
        self.lora_request = lora_request
        # A pooling request runs its whole prompt in one step (never chunked, no
        # prefix-cache hits) and finishes with an embedding instead of tokens.
        self.pooling_params = pooling_params
        # [num_prompt_tokens, hidden] CPU tensor; prompt_token_ids are then placeholders.
        self.prompt_embeds = prompt_embeds
        # What the model's encoder reads (an encoder-decoder's audio features, a CPU
        # tensor): the encoder runs in the step that computes the request's first token
        # (again after a preemption), within the scheduler's encoder budget.
        self.encoder_inputs = encoder_inputs
        self.num_encoder_tokens = num_encoder_tokens if encoder_inputs is not None else 0
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache; -1: not yet known
        self.num_preemptions = 0
        # Tokens scheduled to be sampled whose ids have not come back yet (async
        # scheduling): the scheduler may schedule their successors already.
        self.num_output_placeholders = 0
        self.stop_reason: int | str | None = None
        # Speculative decoding: tokens proposed to follow all_token_ids, verified by the
        # request's next step (spindle/runner/spec_decode/).
        self.spec_token_ids: list[int] = []
        self.num_proposed = 0  # of the drafts its last step verified, those proposed
        # Whether its tokens rotate by LongRoPE's long factors: set once it is longer
        # than the original length (ModelConfig.long_rope_from), for good.
        self.rope_long = False
        # Chained hashes of this request's full blocks, filled by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # Asked for prompt logprobs: an entry per prompt token after the first, filled
        # as its prefill chunks are computed and reported with its first token.
        wants = pooling_params is None and getattr(sampling_params, "prompt_logprobs",
                                                   None) is not None
        self.prompt_logprobs: list | None = (
            [None] * max(0, len(self.prompt_token_ids) - 1) if wants else None)
        # The sampling params the runner gets (the prompt logprobs left out once sent).
        self.runner_sampling_params = sampling_params

    def prompt_logprobs_delivered(self) -> None:
        """Its prompt logprobs went out with its first token: none are kept or computed
        any more."""
        self.prompt_logprobs = None
        self.runner_sampling_params = dataclasses.replace(self.sampling_params,
                                                          prompt_logprobs=None)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    @property
    def lora_int_id(self) -> int | None:
        return None if self.lora_request is None else self.lora_request.lora_int_id

    def encode_long(self) -> None:
        """From now on its tokens rotate by LongRoPE's long factors: the block hashes of
        its short encoding no longer name its blocks (they are made again)."""
        self.rope_long = True
        self.block_hashes = []

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
